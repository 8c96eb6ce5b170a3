/* tu_avx512.c - the avx512 row: compiled once, with the flags isa_rows.def gives it (the build
   also passes them as KV_ROW_CFLAGS). */
#include "vec_avx512.h"
#include "row.inc.h"
