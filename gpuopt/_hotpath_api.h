/* gpuopt._hotpath's C API, for agent/step/_hot.c (a capsule: HOTPATH_API_NAME).
 *
 * The run's boundary (agent.step._hot.RunPath) calls a data position's window_done and a
 * window meter's take at every optimizer step; through these it calls them without a
 * method lookup, a tuple or an argument's conversion. The agent's hot path reads a host
 * loss through host_scalar while its I/O thread is behind. */
#ifndef GPUWATCH_HOTPATH_API_H
#define GPUWATCH_HOTPATH_API_H

#include <Python.h>

#define HOTPATH_API_NAME "gpuopt._hotpath._C_API"

typedef struct {
    /* gpuopt._hotpath.PositionCounts, the base of gpuopt.position.DataPosition */
    PyTypeObject *counts_type;
    /* gpuopt._hotpath.WindowMeter */
    PyTypeObject *meter_type;
    /* PositionCounts.window_done(micro_batches) of a PositionCounts: 0, or -1 with an
     * exception set */
    int (*window_done)(PyObject *counts, Py_ssize_t micro_batches);
    /* WindowMeter.take() of a WindowMeter, into the four pointers (``tokens``: a new
     * reference); 0, or -1 with an exception set */
    int (*meter_take)(PyObject *meter, double *data_wait_s, Py_ssize_t *fetched,
                      Py_ssize_t *samples, PyObject **tokens);
    /* 1 and the value of ``tensor`` in *value where it is a 0-dim float32 or float64 CPU
     * tensor read from memory (``item()``'s value, no call); 0 otherwise (never raises) */
    int (*host_scalar)(PyObject *tensor, double *value);
} HotpathAPI;

#endif
