/* tu_scalar.c - the scalar row: compiled once, with the flags isa_rows.def gives it (the build
   also passes them as KV_ROW_CFLAGS). */
#include "vec_scalar.h"
#include "row.inc.h"
