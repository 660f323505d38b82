// The integer products with rows as one 8-bit code an input (int4_vnni8_mm): int4_vnni.cpp compiled a second time, in
// a translation unit of its own, so that a first build compiles the two row forms' template instances (row counts x
// code widths x scale sources, each) on two cores at once instead of one after the other on one.
#define HIERSPEC_VNNI_ONE_CODE
#include "int4_vnni.cpp"
