/* tu_scalar.c - the scalar row: compiled once, with this ISA's flags only. */
#include "vec_scalar.h"
#define KV_ROW_REQUIRED 0
#define KV_ROW_CFLAGS "(baseline x86-64)"
#include "row.inc.h"
