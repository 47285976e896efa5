/* The machine's memory read bandwidth: what a memory-bound decode step's roof is (specdec profile).
 *
 * A streaming read of a buffer far larger than the caches, on `threads` threads (each its own contiguous part,
 * as each of the linears' threads streams its own weights), timed pass by pass; the best pass is the
 * bandwidth.  The buffer asks for transparent huge pages, as the gguf target's packed weights do
 * (specdec.native.gguf): the roof is what the weights' own kind of memory reads at.  The sum of the bytes
 * is returned beside it so that no compiler drops the reads.
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef __linux__
#include <sys/mman.h>
#endif

#include "specdec_kernels.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define SD_X86 1
#endif

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static uint64_t sum_c(const uint64_t *p, size_t words) {
    uint64_t a = 0, b = 0, c = 0, d = 0;
    for (size_t i = 0; i + 4 <= words; i += 4) {
        a += p[i];
        b += p[i + 1];
        c += p[i + 2];
        d += p[i + 3];
    }
    return a + b + c + d;
}

#ifdef SD_X86
__attribute__((target("avx2"))) static uint64_t sum_avx2(const uint8_t *p, size_t bytes) {
    __m256i a = _mm256_setzero_si256(), b = a, c = a, d = a;
    for (size_t i = 0; i + 128 <= bytes; i += 128) {
        a = _mm256_add_epi64(a, _mm256_load_si256((const __m256i *)(p + i)));
        b = _mm256_add_epi64(b, _mm256_load_si256((const __m256i *)(p + i + 32)));
        c = _mm256_add_epi64(c, _mm256_load_si256((const __m256i *)(p + i + 64)));
        d = _mm256_add_epi64(d, _mm256_load_si256((const __m256i *)(p + i + 96)));
    }
    uint64_t lanes[4];
    _mm256_storeu_si256((__m256i *)lanes, _mm256_add_epi64(_mm256_add_epi64(a, b), _mm256_add_epi64(c, d)));
    return lanes[0] + lanes[1] + lanes[2] + lanes[3];
}
#endif

static uint64_t sum_bytes(const uint8_t *p, size_t bytes) {
#ifdef SD_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && sd_isa_limit() >= ISA_AVX2) return sum_avx2(p, bytes);
#endif
    return sum_c((const uint64_t *)p, bytes / 8);
}

/* GB/s of the best of `passes` reads of a `bytes` buffer (made here, written once) on `threads` threads;
 * *checksum gets the bytes' sum.  Returns a negative number when out of memory. */
double sd_read_bandwidth(int64_t bytes, int threads, int passes, uint64_t *checksum) {
    bytes = bytes / (128 * 64) * (128 * 64);
    if (threads < 1) threads = 1;
    uint8_t *buffer = aligned_alloc(2 << 20, (size_t)bytes);
    if (!buffer) return -1.0;
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    madvise(buffer, (size_t)bytes, MADV_HUGEPAGE); /* where the kernel allows: else small pages */
#endif
    memset(buffer, 1, (size_t)bytes);
    const size_t part = (size_t)bytes / (size_t)threads / 128 * 128;
    double best = 0.0;
    uint64_t total = 0;
    for (int pass = 0; pass < passes; pass++) {
        uint64_t sum = 0;
        const double start = seconds();
#ifdef _OPENMP
#pragma omp parallel for schedule(static, 1) num_threads(threads) reduction(+ : sum)
#endif
        for (int t = 0; t < threads; t++) sum += sum_bytes(buffer + (size_t)t * part, part);
        const double rate = (double)part * threads / (seconds() - start) / 1e9;
        best = rate > best ? rate : best;
        total += sum;
    }
    free(buffer);
    if (checksum) *checksum = total;
    return best;
}
