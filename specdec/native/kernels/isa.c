/* The paths a user allows: SPECDEC_ISA caps every kernel's path at "c" or "avx2" where the CPU has more, so that
 * a developer on an AVX-512 machine runs the whole program as an AVX2-only (or a portable C) CPU would.  Unset,
 * empty or "best": no cap.  The Python side (bindings.py) checks the value before the library loads. */
#include <stdlib.h>
#include <string.h>

#include "specdec_kernels.h"

int sd_isa_limit(void) {
    static int cached = -1;
    if (cached < 0) {
        const char *value = getenv("SPECDEC_ISA");
        cached = !value ? ISA_LIMIT_NONE
                 : strcmp(value, "c") == 0 ? ISA_C
                 : strcmp(value, "avx2") == 0 ? ISA_AVX2
                 : ISA_LIMIT_NONE;
    }
    return cached;
}
