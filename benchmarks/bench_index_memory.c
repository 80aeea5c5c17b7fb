/*
 * Why a cold pick_kv costs what it does: the memory cost of touching one random 32-byte slot per
 * block in a table of the index's size, the way pick_kv's walk does (a load of the slot's key,
 * 16 slots prefetched ahead), in four cache states. native/README.md "Measured cost" quotes it.
 *
 *   gcc -O2 -o /tmp/bench_index_memory benchmarks/bench_index_memory.c && /tmp/bench_index_memory
 *   /tmp/bench_index_memory huge    # the table on transparent 2 MiB pages (private memory)
 *
 * States, before each walk of 1024 random slots:
 *   all cold      64 MiB of other memory written: slots, page-table lines and TLB all cold
 *   data cold     the slots' lines flushed (clflush); TLB and page tables warm
 *   TLB cold      one byte written per 4 KiB page of 64 MiB: TLB cold, the slots and most
 *                 page-table lines still cached
 *   TLB+data cold both of the above
 *   warm          the same slots walked just before
 * Prefetch distance 0 (independent loads only) and 16 (pick_kv's PREFETCH).
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define N 1024
#define REPS 41
static uint64_t *tab;
static const size_t cap = (size_t)1 << 22; /* slots: the bench's 4M-slot index, 128 MiB */
static char *junk;
static const size_t junklen = (size_t)64 << 20;
static uint64_t idx[N];
static uint64_t rng = 88172645463325252ULL;

static uint64_t now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000ULL + (uint64_t)t.tv_nsec;
}

static uint64_t xorshift(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static uint64_t walk(int dist)
{
    uint64_t acc = 0;
    for (int j = 0; j < dist && j < N; j++)
        __builtin_prefetch(&tab[idx[j] * 4]);
    for (int j = 0; j < N; j++) {
        if (dist && j + dist < N)
            __builtin_prefetch(&tab[idx[j + dist] * 4]);
        acc += __atomic_load_n(&tab[idx[j] * 4], __ATOMIC_ACQUIRE);
    }
    return acc;
}

enum { ALL_COLD, DATA_COLD, TLB_COLD, TLB_DATA_COLD, WARM };
static const char *names[] = {"all cold", "data cold", "TLB cold", "TLB+data cold", "warm"};

static void prepare(int state)
{
    if (state == ALL_COLD) {
        for (size_t i = 0; i < junklen; i += 64)
            junk[i]++;
        return;
    }
    walk(16); /* the slots and their translations are warm */
    if (state == TLB_COLD || state == TLB_DATA_COLD)
        for (size_t i = 0; i < junklen; i += 4096)
            junk[i]++;
#if defined(__x86_64__)
    if (state == DATA_COLD || state == TLB_DATA_COLD) {
        for (int j = 0; j < N; j++)
            _mm_clflush(&tab[idx[j] * 4]);
        _mm_mfence();
    }
#endif
}

int main(int argc, char **argv)
{
    int huge = argc > 1 && strcmp(argv[1], "huge") == 0;
    volatile uint64_t sink = 0;
    tab = mmap(NULL, cap * 32, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    junk = malloc(junklen);
    if (tab == MAP_FAILED || junk == NULL)
        return 1;
    madvise(tab, cap * 32, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
    memset(tab, 1, cap * 32);
    memset(junk, 0, junklen);
    printf("%zu MiB table on %s pages, walks of %d random slots; ns per slot, median (min) of %d\n",
           cap * 32 >> 20, huge ? "2 MiB (THP)" : "4 KiB", N, REPS);
    for (int state = ALL_COLD; state <= WARM; state++) {
        printf("  %-14s", names[state]);
        for (int dist = 0; dist <= 16; dist += 16) {
            uint64_t t[REPS];
            for (int r = 0; r < REPS; r++) {
                for (int j = 0; j < N; j++)
                    idx[j] = xorshift() & (cap - 1);
                prepare(state);
                uint64_t a = now_ns();
                sink += walk(dist);
                t[r] = now_ns() - a;
            }
            qsort(t, REPS, sizeof t[0], cmp_u64);
            printf("  prefetch %2d: %5.1f (%5.1f)", dist, (double)t[REPS / 2] / N, (double)t[0] / N);
        }
        printf("\n");
    }
    return (int)(sink & 0);
}
