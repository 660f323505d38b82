from hierspec.text import FullDecode, StreamDecode, TextAssembler
from tiny import make_tokenizer


def _decoder(pieces):
    return FullDecode(lambda ids: "".join(pieces[i] for i in ids))


def test_stop_string_cuts_text_and_ends_stream():
    pieces = {1: "Hello", 2: " world", 3: "\n", 4: "\nBye", 5: "!"}
    assembler = TextAssembler(_decoder(pieces), stop=["\n\n"])
    assert assembler.feed([1, 2]) == "Hello world"
    assert assembler.feed([3]) == ""  # "\n" might start the stop string: held back
    assert assembler.feed([4]) == ""
    assert assembler.stopped
    assert assembler.text == "Hello world"
    assert assembler.finish() == ""
    assert assembler.feed([5]) == ""


def test_held_back_prefix_is_released_when_it_does_not_complete_a_stop():
    pieces = {1: "a\n", 2: "b"}
    assembler = TextAssembler(_decoder(pieces), stop=["\n\n"])
    assert assembler.feed([1]) == "a"
    assert assembler.feed([2]) == "\nb"
    assert not assembler.stopped


def test_incomplete_utf8_is_held_back():
    pieces = {1: "caf", 2: "\ufffd", 3: "é"}

    def decode(ids):
        # token 2 alone is half of a character; once 3 follows, the pair decodes to "é"
        text = "".join(pieces[i] for i in ids)
        return text.replace("\ufffdé", "é")

    assembler = TextAssembler(FullDecode(decode))
    assert assembler.feed([1, 2]) == "caf"
    assert assembler.feed([3]) == "é"


def test_stop_across_multiple_stop_strings_takes_the_earliest():
    pieces = {1: "one END two STOP"}
    assembler = TextAssembler(_decoder(pieces), stop=["STOP", "END"])
    assembler.feed([1])
    assert assembler.stopped and assembler.text == "one "


def test_deltas_concatenate_to_the_final_text():
    pieces = {i: f"t{i} " for i in range(10)}
    assembler = TextAssembler(_decoder(pieces), stop=["t7"])
    out = "".join(assembler.feed([i]) for i in range(10)) + assembler.finish()
    assert out == assembler.text == "t0 t1 t2 t3 t4 t5 t6 "


def test_stream_decoding_equals_decoding_everything_again():
    tokenizer = make_tokenizer(32)

    def decode(ids):
        return tokenizer.decode(ids, skip_special_tokens=True)

    ids = [3, 5, 7, 0, 9, 11, 2, 2, 30]  # w0 is the end-of-sequence token: skipped
    streamed, full = TextAssembler(StreamDecode(tokenizer, decode)), TextAssembler(FullDecode(decode))
    deltas = [streamed.feed(ids[i : i + 2]) for i in range(0, len(ids), 2)]
    [full.feed(ids[i : i + 2]) for i in range(0, len(ids), 2)]
    deltas.append(streamed.finish())
    full.finish()
    assert "".join(deltas) == streamed.text == full.text == decode(ids)
