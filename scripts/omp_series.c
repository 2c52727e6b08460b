/* A C-only model of a decode benchmark's series, for scripts/bench_omp_series.py (issue 50: are the bimodal -t 2
 * decode series ours or the machine's?).
 *
 * A "token" reads `mib` MiB of weights in `regions` OpenMP parallel regions (the decode stack opens about two a
 * layer: attention, FFN), each region one slice of the buffer shared by the team, an integer sum per thread (vectorised: the
 * loop streams memory as the kernels do, not bound by a float add chain). A "run" is
 * `tokens` tokens; the program prints one line per run: tok/s and the steal / idle jiffies of the machine in it.
 * Nothing of the engine is here: no Python, no torch, no ctypes, no thread governor.
 *
 * Build: cc -O3 -fopenmp omp_series.c -o omp_series
 * Usage: omp_series MIB REGIONS TOKENS RUNS THREADS
 */
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* steal and idle jiffies of all CPUs (/proc/stat's first line), 0 where unreadable */
static void cpu_jiffies(long long *steal, long long *idle) {
    long long v[10] = {0};
    *steal = *idle = 0;
    FILE *f = fopen("/proc/stat", "r");
    if (f == NULL) return;
    if (fscanf(f, "cpu %lld %lld %lld %lld %lld %lld %lld %lld", &v[0], &v[1], &v[2], &v[3], &v[4], &v[5], &v[6],
               &v[7]) == 8) {
        *idle = v[3];
        *steal = v[7];
    }
    fclose(f);
}

int main(int argc, char **argv) {
    if (argc != 6) {
        fprintf(stderr, "usage: %s MIB REGIONS TOKENS RUNS THREADS\n", argv[0]);
        return 1;
    }
    const long mib = atol(argv[1]), regions = atol(argv[2]), tokens = atol(argv[3]), runs = atol(argv[4]);
    const int threads = atoi(argv[5]);
    if (mib <= 0 || mib > 4096 || regions <= 0 || tokens <= 0 || runs <= 0 || threads <= 0 || threads > 64) {
        fprintf(stderr, "bad arguments\n");
        return 1;
    }
    const size_t n = (size_t)mib << 18; /* 4-byte words */
    uint32_t *buf = aligned_alloc(64, n * sizeof(uint32_t));
    if (buf == NULL) {
        fprintf(stderr, "out of memory\n");
        return 1;
    }
    for (size_t i = 0; i < n; i++) buf[i] = (uint32_t)(i * 2654435761u);
    const size_t slice = n / (size_t)regions;
    volatile uint32_t sink = 0;
    for (long r = 0; r < runs; r++) {
        long long s0, i0, s1, i1;
        cpu_jiffies(&s0, &i0);
        const double t0 = now();
        for (long t = 0; t < tokens; t++) {
            for (long g = 0; g < regions; g++) {
                const uint32_t *p = buf + g * slice;
                uint32_t total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
                {
                    const int me = omp_get_thread_num(), all = omp_get_num_threads();
                    const size_t a = slice * me / all, b = slice * (me + 1) / all;
                    uint32_t s = 0;
                    for (size_t i = a; i < b; i++) s += p[i];
                    total += s;
                }
                sink += total;
            }
        }
        const double dt = now() - t0;
        cpu_jiffies(&s1, &i1);
        printf("%.2f %lld %lld\n", tokens / dt, s1 - s0, i1 - i0);
        fflush(stdout);
    }
    free(buf);
    return sink == 12345u;
}
