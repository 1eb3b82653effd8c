/* Throughput of the AVX2 integer instructions the quantized kernels are built from, on this core:
 * independent vpmaddubsw, vpaddw and vpmaddwd, then the Q4_K prefill tile's inner step (one weight
 * load and mask, four activation broadcasts, four vpmaddubsw + vpaddw) with vpbroadcastd,
 * vbroadcastss and no broadcast. Prints cycles per loop iteration at the clock given as the first
 * argument in GHz (measure it with a dependent-add loop; the VMs here have no cycle counters).
 *
 *   gcc -O2 scripts/simd-pipes.c -o simd-pipes && ./simd-pipes 3.07
 */
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <time.h>

static double now(void) {
    struct timespec a;
    clock_gettime(CLOCK_MONOTONIC, &a);
    return a.tv_sec + a.tv_nsec * 1e-9;
}

static int32_t buf[64] __attribute__((aligned(64)));
static const long N = 200000000;
static double ghz = 3.0;

#define CLOBBER "memory", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9"
#define RUN(name, body)                                                         \
    do {                                                                        \
        long m = N;                                                             \
        double t0 = now();                                                      \
        __asm__ volatile(body : "+r"(m) : "r"(buf) : CLOBBER);                  \
        printf("%-36s %.2f cycles/iter\n", name, (now() - t0) * ghz * 1e9 / N); \
    } while (0)

#define X8(op) "1:\n" op(0) op(1) op(2) op(3) op(4) op(5) op(6) op(7) "dec %0\n jnz 1b\n"
#define MADDUBS(i) "vpmaddubsw %%ymm9,%%ymm8,%%ymm" #i "\n"
#define PADDW(i) "vpaddw %%ymm9,%%ymm" #i ",%%ymm" #i "\n"
#define MADDWD(i) "vpmaddwd %%ymm9,%%ymm8,%%ymm" #i "\n"
#define STEP(BC, off, t, a)                                                     \
    BC " " #off "(%1),%%ymm" #t "\n vpmaddubsw %%ymm" #t ",%%ymm8,%%ymm" #t "\n" \
       " vpaddw %%ymm" #t ",%%ymm" #a ",%%ymm" #a "\n"
#define TILE(BC) "1:\n vmovdqu (%1),%%ymm8\n vpand %%ymm8,%%ymm9,%%ymm8\n" \
    STEP(BC, 0, 0, 1) STEP(BC, 4, 2, 3) STEP(BC, 8, 4, 5) STEP(BC, 12, 6, 7) "dec %0\n jnz 1b\n"
#define NOBC(i, a) "vpmaddubsw %%ymm9,%%ymm8,%%ymm" #i "\n vpaddw %%ymm" #i ",%%ymm" #a ",%%ymm" #a "\n"

int main(int argc, char **argv) {
    if (argc > 1) ghz = atof(argv[1]);
    RUN("8 vpmaddubsw", X8(MADDUBS));
    RUN("8 vpaddw", X8(PADDW));
    RUN("8 vpmaddwd", X8(MADDWD));
    RUN("Q4_K step, vpbroadcastd", TILE("vpbroadcastd"));
    RUN("Q4_K step, vbroadcastss", TILE("vbroadcastss"));
    RUN("Q4_K step, no broadcast",
        "1:\n vmovdqu (%1),%%ymm8\n vpand %%ymm8,%%ymm9,%%ymm8\n" NOBC(0, 1) NOBC(2, 3) NOBC(4, 5)
            NOBC(6, 7) "dec %0\n jnz 1b\n");
    return 0;
}
