/* tu_avx2.c - the avx2 row: compiled once, with the flags isa_rows.def gives it (the build
   also passes them as KV_ROW_CFLAGS). */
#include "vec_avx2.h"
#include "row.inc.h"
