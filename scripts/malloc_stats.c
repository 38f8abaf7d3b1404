/*
 * malloc_stats.so: prints glibc's heap statistics of the process it is
 * preloaded into, every MALLOC_STATS_PERIOD seconds (default 30), one line
 * on stderr:
 *
 *   MALLOC_STATS t=<s> in_use=<bytes> free_in_arenas=<bytes> arenas=<bytes>
 *                mmapped=<bytes> top_releasable=<bytes>
 *
 * `in_use` is what the program holds (mallinfo2's uordblks + hblkhd);
 * `arenas` what malloc took from the system for its arenas (arena); the
 * difference, `free_in_arenas` (fordblks), is freed memory malloc keeps.
 * Resident memory that grows while `in_use` stays flat is the allocator,
 * not a leak. Used by the soak (cli/tests/real_soak.rs) through
 * SOAK_DECODE_ENV:
 *
 *   cc -shared -fPIC -O2 -o target/malloc_stats.so scripts/malloc_stats.c -lpthread
 *   SOAK_DECODE_ENV="LD_PRELOAD=$PWD/target/malloc_stats.so;MALLOC_STATS_PERIOD=60" \
 *       cargo test -p nixl-keepalive-cli --test real_soak -- --ignored --nocapture
 */
#define _GNU_SOURCE
#include <malloc.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

static void *
report_loop(void *arg) {
    unsigned period = *(unsigned *)arg;
    struct timespec start, now;
    clock_gettime(CLOCK_MONOTONIC, &start);
    for (;;) {
        sleep(period);
        struct mallinfo2 mi = mallinfo2();
        clock_gettime(CLOCK_MONOTONIC, &now);
        fprintf(stderr,
                "MALLOC_STATS t=%ld in_use=%zu free_in_arenas=%zu arenas=%zu mmapped=%zu "
                "top_releasable=%zu\n",
                (long)(now.tv_sec - start.tv_sec), mi.uordblks + mi.hblkhd, mi.fordblks,
                mi.arena, mi.hblkhd, mi.keepcost);
        fflush(stderr);
    }
    return NULL;
}

__attribute__((constructor)) static void
start_reporting(void) {
    static unsigned period = 30;
    const char *p = getenv("MALLOC_STATS_PERIOD");
    if (p && atoi(p) > 0) {
        period = (unsigned)atoi(p);
    }
    /* Only the process the variable was meant for: not its children. */
    unsetenv("LD_PRELOAD");
    pthread_t t;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_create(&t, &attr, report_loop, &period);
    pthread_attr_destroy(&attr);
}
