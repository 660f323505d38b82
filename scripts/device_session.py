"""The checks a lent GPU runs, prepared so that a session spends its device time on them (the ``device`` tool).

A lent machine has PyTorch and Triton but not every package hierspec needs, no network, and a call carries at most
64 MiB of ignored files; it stays warm for 30 s after a call, so a second call finds what the first left in its home
directory. The default model's GGUF (~98 MB) therefore travels in two parts, one a call:

    python scripts/device_session.py prepare     # here, once per checkout: .devrun/wheels, .devrun/part-1, part-2

then with the device tool, the second call within 30 s of the first one's end:

    run(command="python3 scripts/device_session.py tests", carry=[".devrun/wheels", ".devrun/part-1"])
    run(command="python3 scripts/device_session.py bench", carry=[".devrun/part-2"])

``stash`` installs the wheels into the machine's home and keeps part 1 there; ``tests`` does that, then runs the CUDA
tests. In the second call, carrying part 2, ``bench`` joins the model (its SHA-256 checked against ``prepare``'s) and
runs the dev bench with the fused layers, again with ``--decoder transformers`` (the stock modules, for comparison)
and with the fused layers once more, ``hierspec calibrate`` and the forward profiles; ``run -- CMD …`` instead runs
any command with ``{model}`` standing for the joined model (``python3 scripts/step_overhead.py --model {model}``).
Each command's log, and each bench's ``report.md`` and ``summary.json``, come back under ``$OUT`` (the seventieth
session's ``tests`` and ``bench`` calls: 106 s and 184 s). The stages use the standard library only, so they run
before anything is installed.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEVRUN = ROOT / ".devrun"
#: a call's carried files at most (the device tool's limit), less room for the checkout's own small files
CARRY_LIMIT = 60 * 2**20
#: the packages a lent machine lacked (sessions 68-69), for its Python: at the versions installed here, except where
#: pinned — transformers 5.25 wants huggingface-hub >= 2.4, and the machine has 1.33 (seventieth session)
DEVICE_PACKAGES = ("transformers", "gguf", "pydivsufsort")
DEVICE_PINS = {"transformers": "5.24.0"}
DEVICE_PYTHON = "3.12"
DEVICE_PLATFORM = "manylinux_2_28_x86_64"
#: where a warm machine keeps what the first call left for the second
DEVICE_HOME = Path.home() / "hierspec-device"
CUDA_TESTS = ("tests/test_cuda.py", "tests/test_cuda_fusion.py", "tests/test_cuda_attention.py",
              "tests/test_graphs.py")
_CHUNK = 1 << 20


def sha256(path: Path) -> str:
    """``hierspec.checksums.file_sha256``'s digest, standard library only: the device stages run before the packages
    ``import hierspec`` needs are installed there."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def split_file(source: Path, first_bytes: int, parts: tuple[Path, Path]) -> str:
    """``source`` cut into ``parts[0]`` (its first ``first_bytes``) and ``parts[1]`` (the rest); returns its
    SHA-256, which :func:`join_parts` checks."""
    for part in parts:
        part.parent.mkdir(parents=True, exist_ok=True)
    with open(source, "rb") as src:
        for part, size in zip(parts, (first_bytes, None)):
            with open(part, "wb") as out:
                if size is None:
                    shutil.copyfileobj(src, out, _CHUNK)
                else:
                    out.write(src.read(size))
    return sha256(source)


def join_parts(parts: list[Path], expected_sha256: str, out: Path) -> Path:
    """The parts concatenated into ``out``, published only when the whole matches ``expected_sha256`` (else a
    ``ValueError`` and no ``out``)."""
    partial = out.with_name(out.name + ".partial")
    with open(partial, "wb") as joined:
        for part in parts:
            with open(part, "rb") as src:
                shutil.copyfileobj(src, joined, _CHUNK)
    found = sha256(partial)
    if found != expected_sha256:
        partial.unlink()
        raise ValueError(f"joined parts have SHA-256 {found}, expected {expected_sha256}")
    os.replace(partial, out)
    return out


def download_wheels(dest: Path) -> list[Path]:
    """Wheels of :data:`DEVICE_PACKAGES` at this environment's versions, for the device's Python."""
    from importlib.metadata import version

    dest.mkdir(parents=True, exist_ok=True)
    for stale in dest.glob("*.whl"):
        stale.unlink()
    for package in DEVICE_PACKAGES:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                        "--python-version", DEVICE_PYTHON, "--implementation", "cp", "--platform", DEVICE_PLATFORM,
                        "-d", str(dest), f"{package}=={DEVICE_PINS.get(package) or version(package)}"], check=True)
    return sorted(dest.glob("*.whl"))


def prepare(devrun: Path) -> None:
    from hierspec.loading import default_model_path

    wheels = download_wheels(devrun / "wheels")
    wheel_bytes = sum(w.stat().st_size for w in wheels)
    model = default_model_path()
    first = CARRY_LIMIT - wheel_bytes
    rest = model.stat().st_size - first
    if first <= 0 or rest > CARRY_LIMIT:
        raise SystemExit(f"{model.name} ({model.stat().st_size} bytes) does not fit two calls beside the wheels")
    digest = split_file(model, first, (devrun / "part-1" / "model.part", devrun / "part-2" / "model.part"))
    (devrun / "part-2" / "model.sha256").write_text(digest + "\n")
    print(f"{len(wheels)} wheels ({wheel_bytes / 2**20:.1f} MiB), {model.name} in parts of "
          f"{first / 2**20:.1f} + {rest / 2**20:.1f} MiB (SHA-256 {digest[:12]}…) under {devrun}")


def _run(command: list[str], env: dict, log: Path | None = None, timeout: int = 400) -> int:
    print("$ " + " ".join(command), flush=True)
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as expired:
        print(f"timed out after {timeout} s", flush=True)
        output, code = str(expired.stdout or "") + str(expired.stderr or ""), 124
    else:
        output, code = done.stdout + done.stderr, done.returncode
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(output)
    print("\n".join(output.splitlines()[-25:]), flush=True)
    return code


def _environment() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(DEVICE_HOME / "site"), str(ROOT / "src")])
    return env


def stash(devrun: Path) -> None:
    """The wheels installed into the machine's home, and part 1 of the model kept there for the next call."""
    DEVICE_HOME.mkdir(parents=True, exist_ok=True)
    shutil.copy(devrun / "part-1" / "model.part", DEVICE_HOME / "model.part-1")
    wheels = sorted(str(w) for w in (devrun / "wheels").glob("*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile",
                    "--upgrade", "--target", str(DEVICE_HOME / "site"), *wheels], check=True)


def _out() -> Path:
    return Path(os.environ.get("OUT", DEVICE_HOME / "out"))


def tests(devrun: Path, timeout: int) -> int:
    stash(devrun)
    return _run([sys.executable, "-m", "pytest", "-n", "8", "-p", "no:cacheprovider", "-q", *CUDA_TESTS],
                _environment(), _out() / "cuda-tests.log", timeout)


def joined_model(devrun: Path) -> Path:
    """The model joined from part 1 (kept by an earlier call) and part 2 (carried by this one)."""
    expected = (devrun / "part-2" / "model.sha256").read_text().strip()
    return join_parts([DEVICE_HOME / "model.part-1", devrun / "part-2" / "model.part"], expected,
                      DEVICE_HOME / "model.gguf")


def run_command(devrun: Path, command: list[str], timeout: int) -> int:
    """Any command (``{model}``, also inside an argument, standing for the joined model's path) with the installed
    packages on the path."""
    model = str(joined_model(devrun))
    return _run([part.replace("{model}", model) for part in command], _environment(), _out() / "command.log", timeout)


def bench(devrun: Path, per_category: int, max_new_tokens: int, methods: str) -> int:
    model = joined_model(devrun)
    env, out = _environment(), _out()
    hierspec = [sys.executable, "-c", "import sys; from hierspec.cli import main; sys.exit(main(sys.argv[1:]))"]
    common = ["bench", "--questions", "data/spec_bench_dev.jsonl", "--first-turn-only", "--per-category",
              str(per_category), "--max-new-tokens", str(max_new_tokens), "--model", str(model), "--device", "cuda",
              "--methods", methods]
    codes = []
    for name, extra in (("fused", []), ("stock", ["--decoder", "transformers"]), ("fused-again", [])):
        reports = DEVICE_HOME / "reports" / name  # a report's plots and answers are more files than a call brings back
        codes.append(_run(hierspec + common + extra + ["--out", str(reports)], env, out / f"{name}.log"))
        for kept in ("report.md", "summary.json"):
            if (reports / kept).is_file():
                shutil.copy(reports / kept, out / f"{name}-{kept}")
    codes.append(_run(hierspec + ["calibrate", "--model", str(model), "--device", "cuda", "--max-tokens", "64",
                                  "--out", str(out / "curve.json")], env, out / "calibrate.log"))
    for shape, tokens in (("smollm2-135m", 1), ("smollm2-135m", 16), ("qwen2.5-1.5b", 1)):
        codes.append(_run([sys.executable, "scripts/cuda_forward_profile.py", "--shape", shape, "--tokens",
                           str(tokens)], env, out / f"profile-{shape}-{tokens}.log"))
    return max(codes)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stage", choices=["prepare", "stash", "tests", "bench", "run"])
    parser.add_argument("--devrun", type=Path, default=DEVRUN, help="where prepare writes and the stages read")
    parser.add_argument("--timeout", type=int, default=300, help="tests: seconds for the CUDA tests")
    parser.add_argument("--per-category", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--methods", default="ar,pld,hd")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="run: the command, after --")
    args = parser.parse_args()
    if args.stage == "prepare":
        prepare(args.devrun)
        return 0
    if args.stage == "stash":
        stash(args.devrun)
        return 0
    if args.stage == "tests":
        return tests(args.devrun, args.timeout)
    if args.stage == "run":
        command = args.command[1:] if args.command[:1] == ["--"] else args.command
        if not command:
            parser.error("run needs a command after --")
        return run_command(args.devrun, command, args.timeout)
    return bench(args.devrun, args.per_category, args.max_new_tokens, args.methods)


if __name__ == "__main__":
    sys.exit(main())
