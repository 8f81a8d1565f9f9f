/* The hot path's clock, shared by gpuopt/_hotpath.c and agent/step/_hot.c.
 *
 * CLOCK_MONOTONIC, in seconds: time.perf_counter's clock on Linux. A vDSO read, no system
 * call; the fetch's data wait and the boundary's step time are both differences of it. */
#ifndef GPUWATCH_HOTCLOCK_H
#define GPUWATCH_HOTCLOCK_H

#include <time.h>

static inline double
now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

#endif
