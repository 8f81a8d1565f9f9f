/* What gpuopt/_hotpath.c and agent/step/_hot.c share.
 *
 * - now_s(): the hot path's clock. CLOCK_MONOTONIC, in seconds: time.perf_counter's clock
 *   on Linux. A vDSO read, no system call; the fetch's data wait and the boundary's step
 *   time are both differences of it.
 * - A queue kept with its bound append (the agent's _records, a data position's _recent):
 *   the append is looked up once, when the queue is set, not at every step or fetch. */
#ifndef GPUWATCH_HOTSHARED_H
#define GPUWATCH_HOTSHARED_H

#include <Python.h>
#include <time.h>

static inline double
now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* The getter of a queue kept at ``*queue`` (``name`` for its AttributeError when unset). */
static inline PyObject *
queue_get(PyObject *queue, const char *name)
{
    if (queue == NULL) {
        PyErr_SetString(PyExc_AttributeError, name);
        return NULL;
    }
    return Py_NewRef(queue);
}

/* The setter: ``value`` (NULL: deleted) at ``*queue`` and its bound append at ``*append``;
 * -1 with AttributeError, both kept as they were, when ``value`` has no append. */
static inline int
queue_set(PyObject **queue, PyObject **append, PyObject *value)
{
    PyObject *bound = NULL;
    if (value != NULL && (bound = PyObject_GetAttrString(value, "append")) == NULL)
        return -1;
    Py_XSETREF(*queue, Py_XNewRef(value));
    Py_XSETREF(*append, bound);
    return 0;
}

#endif
