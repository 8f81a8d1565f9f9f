/* agent.step._hot: the agent's part of the training thread's optimizer step, in C.
 *
 * - StepRecord (agent.step.record.StepRecord): one is made at every optimizer step. As a
 *   slotted dataclass its __init__ was a Python frame of 13 stores, about 1 us of CPU
 *   between real steps (the caches are cold there); made here, by vectorcall, it is one
 *   allocation and the stores. Its fields, their order and defaults, and their meaning
 *   are StepRecord's docstring's. It is not tracked by the cyclic garbage collector:
 *   nothing it holds (numbers, tensors, a marker, the knob values' dict) refers back to
 *   a record, and hundreds wait in the queue between the I/O thread's passes, which
 *   every collection of the young generations traversed (0.3 to 0.4 us a step of the
 *   training thread's CPU in bench_overhead's paced loop).
 * - HotPath, the base of agent.step.core.Agent: its optimizer_step (a clock read, the
 *   step's marker, a deque append, the pending-command check), with no Python frame
 *   unless listeners or commands wait, the I/O thread is behind, or the marker is a
 *   device's.
 * - host_mark: agent.step.markers.CpuMarker's mark.
 * - RunPath, the base of agent.integrations.run.RunBase: its boundary, and a loop's
 *   optimizer_step (LoopRun's): the window's counts, the record and the boundary with no
 *   Python frame unless the run has more to do at this step (a pause, a recovery, a
 *   rollback's watch, events, a memory snapshot, a window that is not a Session's).
 * - On the I/O thread: columns (a run of records' fields, one list a field, in one pass)
 *   and ShareWindow (the base of agent.step.encoder.InputWindow: each step's data-wait
 *   share over the last steps), where a run of records cost list passes of Python calls.
 *
 * Never synchronizes a device, never blocks. The clock is CLOCK_MONOTONIC (time.perf_counter's
 * on Linux); HotPath.mark_start reads it too.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include "gpuopt/_hotshared.h"
#include "gpuopt/_hotpath_api.h"

static HotpathAPI *hotpath;  /* gpuopt._hotpath's */

#define FIELDS 13
#define REQUIRED 3
/* the fields the hot path reads or sets, by index */
#define MICRO_BATCHES 0
#define LOSS 3
#define SKIPPED 4
#define GRAD_NORM 8
#define STEP 9  /* (the one field whose default is not None: 0) */
#define STEP_TIME_S 10
#define MARKER 11
#define KNOBS 12

static const char *const field_names[FIELDS] = {
    "micro_batches", "samples", "data_wait_s", "loss", "skipped", "activation_bytes",
    "tokens", "lr", "grad_norm", "step", "step_time_s", "marker", "knobs",
};
static PyObject *names[FIELDS];  /* interned */
static PyObject *zero;

typedef struct {
    PyObject_HEAD
    PyObject *values[FIELDS];
} Record;

static PyTypeObject RecordType;

static int
record_set(PyObject **values, PyObject *name, PyObject *value)
{
    for (int i = 0; i < FIELDS; i++) {
        if (name == names[i]) {  /* (interned: the usual keyword) */
            goto found;
        }
    }
    for (int i = 0; i < FIELDS; i++) {
        int equal = PyUnicode_Check(name) ? PyUnicode_Compare(name, names[i]) : -1;
        if (equal == -1 && PyErr_Occurred())
            return -1;
        if (equal == 0) {
            name = names[i];
            goto found;
        }
    }
    PyErr_Format(PyExc_TypeError, "StepRecord() got an unexpected keyword argument %R", name);
    return -1;
found:
    for (int i = 0; i < FIELDS; i++) {
        if (name == names[i]) {
            if (values[i] != NULL) {
                PyErr_Format(PyExc_TypeError, "StepRecord() got multiple values for argument "
                             "'%s'", field_names[i]);
                return -1;
            }
            values[i] = Py_NewRef(value);
            return 0;
        }
    }
    return -1;  /* (not reached) */
}

/* A record from positional ``args`` and keyword ``kwvalues`` named ``kwnames``. */
static PyObject *
record_make(PyTypeObject *type, PyObject *const *args, Py_ssize_t nargs,
            PyObject *const *kwvalues, PyObject *const *kwnames, Py_ssize_t nkw)
{
    if (nargs > FIELDS) {
        PyErr_Format(PyExc_TypeError, "StepRecord() takes at most %d arguments (%zd given)",
                     FIELDS, nargs);
        return NULL;
    }
    Record *self = (Record *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < nargs; i++)
        self->values[i] = Py_NewRef(args[i]);
    for (Py_ssize_t i = 0; i < nkw; i++) {
        if (record_set(self->values, kwnames[i], kwvalues[i]) < 0) {
            Py_DECREF(self);
            return NULL;
        }
    }
    for (int i = 0; i < FIELDS; i++) {
        if (self->values[i] != NULL)
            continue;
        if (i < REQUIRED) {
            PyErr_Format(PyExc_TypeError, "StepRecord() missing required argument '%s'",
                         field_names[i]);
            Py_DECREF(self);
            return NULL;
        }
        self->values[i] = Py_NewRef(i == STEP ? zero : Py_None);
    }
    return (PyObject *)self;
}

static PyObject *
record_vectorcall(PyObject *type, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    Py_ssize_t nkw = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    return record_make((PyTypeObject *)type, args, nargs, args + nargs,
                       nkw ? &PyTuple_GET_ITEM(kwnames, 0) : NULL, nkw);
}

static PyObject *
record_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    Py_ssize_t nkw = kwargs == NULL ? 0 : PyDict_GET_SIZE(kwargs);
    PyObject *keys[FIELDS + 1], *values[FIELDS + 1];
    if (nkw > FIELDS) {
        PyErr_Format(PyExc_TypeError, "StepRecord() takes at most %d arguments", FIELDS);
        return NULL;
    }
    Py_ssize_t position = 0, i = 0;
    PyObject *key, *value;
    while (kwargs != NULL && PyDict_Next(kwargs, &position, &key, &value)) {
        keys[i] = key;
        values[i++] = value;
    }
    return record_make(type, &PyTuple_GET_ITEM(args, 0), PyTuple_GET_SIZE(args), values,
                       keys, nkw);
}

static int
record_clear(Record *self)
{
    for (int i = 0; i < FIELDS; i++)
        Py_CLEAR(self->values[i]);
    return 0;
}

static void
record_dealloc(Record *self)
{
    record_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
record_repr(Record *self)
{
    PyObject *parts = PyList_New(0);
    if (parts == NULL)
        return NULL;
    for (int i = 0; i < FIELDS; i++) {
        PyObject *part = PyUnicode_FromFormat("%s=%R", field_names[i],
                                              self->values[i] ? self->values[i] : Py_None);
        if (part == NULL || PyList_Append(parts, part) < 0) {
            Py_XDECREF(part);
            Py_DECREF(parts);
            return NULL;
        }
        Py_DECREF(part);
    }
    PyObject *separator = PyUnicode_FromString(", ");
    PyObject *joined = separator ? PyUnicode_Join(separator, parts) : NULL;
    Py_XDECREF(separator);
    Py_DECREF(parts);
    if (joined == NULL)
        return NULL;
    PyObject *text = PyUnicode_FromFormat("StepRecord(%U)", joined);
    Py_DECREF(joined);
    return text;
}

static PyMemberDef record_members[FIELDS + 1];

static PyTypeObject RecordType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "agent.step.record.StepRecord",
    .tp_basicsize = sizeof(Record),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = record_new,
    .tp_vectorcall = record_vectorcall,  /* (calling the type; its instances are not callable) */
    .tp_dealloc = (destructor)record_dealloc,
    .tp_repr = (reprfunc)record_repr,
    .tp_members = record_members,
};

/* ------------------------------------------------------------------ host_mark */

/* CpuMarker.mark: the loss itself when there is neither a flag nor a norm, else the
 * tuple (loss, skipped, grad_norm); a new reference. */
static PyObject *
host_mark_of(PyObject *loss, PyObject *skipped, PyObject *grad_norm)
{
    if (grad_norm == Py_None && skipped == Py_None)
        return Py_NewRef(loss);
    return PyTuple_Pack(3, loss, skipped, grad_norm);
}

static PyObject *
host_mark(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 1 || nargs > 3) {
        PyErr_SetString(PyExc_TypeError, "mark(loss, skipped=None, grad_norm=None)");
        return NULL;
    }
    return host_mark_of(args[0], nargs > 1 ? args[1] : Py_None, nargs > 2 ? args[2] : Py_None);
}

/* ------------------------------------------------------------------ columns */

/* columns(records, names): one list per field named, of a list of StepRecords. */
static PyObject *
columns(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyList_Check(args[0]) || !PyTuple_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "columns(records: list, names: tuple)");
        return NULL;
    }
    PyObject *records = args[0], *wanted = args[1];
    Py_ssize_t n = PyList_GET_SIZE(records), k = PyTuple_GET_SIZE(wanted);
    int index[FIELDS];
    if (k > FIELDS) {
        PyErr_SetString(PyExc_ValueError, "columns: more names than a StepRecord's fields");
        return NULL;
    }
    for (Py_ssize_t j = 0; j < k; j++) {
        PyObject *name = PyTuple_GET_ITEM(wanted, j);
        index[j] = -1;
        for (int i = 0; i < FIELDS && index[j] < 0; i++) {
            int equal = PyUnicode_Check(name) ? PyUnicode_Compare(name, names[i]) : -1;
            if (equal == -1 && PyErr_Occurred())
                return NULL;
            if (equal == 0)
                index[j] = i;
        }
        if (index[j] < 0) {
            PyErr_Format(PyExc_ValueError, "columns: a StepRecord has no field %R", name);
            return NULL;
        }
    }
    PyObject *result = PyTuple_New(k);
    if (result == NULL)
        return NULL;
    for (Py_ssize_t j = 0; j < k; j++) {
        PyObject *column = PyList_New(n);
        if (column == NULL) {
            Py_DECREF(result);
            return NULL;
        }
        PyTuple_SET_ITEM(result, j, column);
    }
    for (Py_ssize_t r = 0; r < n; r++) {
        PyObject *record = PyList_GET_ITEM(records, r);
        if (!Py_IS_TYPE(record, &RecordType)) {
            PyErr_Format(PyExc_TypeError, "columns: item %zd is a %.100s, not a StepRecord",
                         r, Py_TYPE(record)->tp_name);
            Py_DECREF(result);
            return NULL;
        }
        PyObject **values = ((Record *)record)->values;
        for (Py_ssize_t j = 0; j < k; j++) {
            PyObject *value = values[index[j]];
            if (value == NULL) {
                PyErr_Format(PyExc_AttributeError, "a StepRecord's %s was deleted",
                             field_names[index[j]]);
                Py_DECREF(result);
                return NULL;
            }
            PyList_SET_ITEM(PyTuple_GET_ITEM(result, j), r, Py_NewRef(value));
        }
    }
    return result;
}

/* ------------------------------------------------------------------ ShareWindow */

typedef struct {
    PyObject_HEAD
    Py_ssize_t size;      /* steps in the window at most */
    Py_ssize_t held;      /* steps in it now */
    Py_ssize_t next;      /* the ring's slot the next step goes to */
    double *waits, *times;
    double bounds[2];     /* shares from which the second, the third verdict is given */
    PyObject *verdicts[3];
} ShareWindow;

static PyObject *
window_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"steps", "bounds", "verdicts", NULL};
    Py_ssize_t size;
    PyObject *verdicts;
    double low, high;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "n(dd)O!:ShareWindow", keywords, &size,
                                     &low, &high, &PyTuple_Type, &verdicts))
        return NULL;
    if (size < 1 || PyTuple_GET_SIZE(verdicts) != 3 || !(low <= high)) {
        PyErr_SetString(PyExc_ValueError, "ShareWindow(steps >= 1, (low, high) with "
                        "low <= high, three verdicts)");
        return NULL;
    }
    ShareWindow *self = (ShareWindow *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->waits = PyMem_Calloc(2 * (size_t)size, sizeof(double));
    if (self->waits == NULL) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    self->times = self->waits + size;
    self->size = size;
    self->bounds[0] = low;
    self->bounds[1] = high;
    for (int i = 0; i < 3; i++)
        self->verdicts[i] = Py_NewRef(PyTuple_GET_ITEM(verdicts, i));
    return (PyObject *)self;
}

static void
window_dealloc(ShareWindow *self)
{
    PyMem_Free(self->waits);
    for (int i = 0; i < 3; i++)
        Py_XDECREF(self->verdicts[i]);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Add one step; its share over the window (0 to 1; 0 while the window's time is not > 0)
 * and its verdict's index. The sums are taken again over the window, oldest first. */
static double
window_add(ShareWindow *self, double wait_s, double time_s, int *verdict)
{
    self->waits[self->next] = wait_s;
    self->times[self->next] = time_s;
    self->next = (self->next + 1) % self->size;
    if (self->held < self->size)
        self->held++;
    double waits = 0.0, times = 0.0;
    Py_ssize_t slot = (self->next - self->held + self->size) % self->size;
    for (Py_ssize_t i = 0; i < self->held; i++) {
        waits += self->waits[slot];
        times += self->times[slot];
        slot = slot + 1 == self->size ? 0 : slot + 1;
    }
    double share = 0.0;
    if (times > 0.0) {
        share = waits / times;
        share = share > 0.0 ? share : 0.0;  /* (NaN: 0) */
        share = share < 1.0 ? share : 1.0;
    }
    *verdict = (share >= self->bounds[0]) + (share >= self->bounds[1]);
    return share;
}

static PyObject *
window_add_one(ShareWindow *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "add(data_wait_s, step_time_s)");
        return NULL;
    }
    double wait_s = PyFloat_AsDouble(args[0]);
    if (wait_s == -1.0 && PyErr_Occurred())
        return NULL;
    double time_s = PyFloat_AsDouble(args[1]);
    if (time_s == -1.0 && PyErr_Occurred())
        return NULL;
    int verdict;
    double share = window_add(self, wait_s, time_s, &verdict);
    return Py_BuildValue("(dO)", share, self->verdicts[verdict]);
}

static PyObject *
window_add_many(ShareWindow *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyList_Check(args[0]) || !PyList_Check(args[1])
            || PyList_GET_SIZE(args[0]) != PyList_GET_SIZE(args[1])) {
        PyErr_SetString(PyExc_TypeError, "add_many(waits: list, times: list), of one length");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(args[0]);
    /* (every value read first: a bad one leaves the window as it was) */
    double *read = PyMem_Malloc(2 * (size_t)(n ? n : 1) * sizeof(double));
    if (read == NULL)
        return PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < 2 * n; i++) {
        /* (a value's __float__ is Python's: it may change the lists being read) */
        PyObject *list = args[i < n ? 0 : 1];
        if (PyList_GET_SIZE(list) != n) {
            PyErr_SetString(PyExc_RuntimeError, "add_many: a list changed size while read");
            PyMem_Free(read);
            return NULL;
        }
        PyObject *item = Py_NewRef(PyList_GET_ITEM(list, i % n));
        read[i] = PyFloat_AsDouble(item);
        Py_DECREF(item);
        if (read[i] == -1.0 && PyErr_Occurred()) {
            PyMem_Free(read);
            return NULL;
        }
    }
    if (PyList_GET_SIZE(args[0]) != n || PyList_GET_SIZE(args[1]) != n) {
        PyErr_SetString(PyExc_RuntimeError, "add_many: a list changed size while read");
        PyMem_Free(read);
        return NULL;
    }
    PyObject *shares = PyList_New(n), *verdicts = PyList_New(n);
    if (shares == NULL || verdicts == NULL)
        goto failed;
    for (Py_ssize_t i = 0; i < n; i++) {
        int verdict;
        PyObject *share = PyFloat_FromDouble(window_add(self, read[i], read[n + i], &verdict));
        if (share == NULL)
            goto failed;
        PyList_SET_ITEM(shares, i, share);
        PyList_SET_ITEM(verdicts, i, Py_NewRef(self->verdicts[verdict]));
    }
    PyMem_Free(read);
    PyObject *result = PyTuple_Pack(2, shares, verdicts);
    Py_DECREF(shares);
    Py_DECREF(verdicts);
    return result;
failed:
    PyMem_Free(read);
    Py_XDECREF(shares);
    Py_XDECREF(verdicts);
    return NULL;
}

static PyMethodDef window_methods[] = {
    {"add", (PyCFunction)(void (*)(void))window_add_one, METH_FASTCALL,
     "add(data_wait_s, step_time_s)\n--\n\n"
     "Add one step; return ``(share, verdict)`` over the window."},
    {"add_many", (PyCFunction)(void (*)(void))window_add_many, METH_FASTCALL,
     "add_many(waits, times)\n--\n\n"
     "Add several steps (two lists of one length); return the lists of the share and the "
     "verdict after each, as :meth:`add` one at a time would, bit for bit. A value that "
     "is not a number raises TypeError before any step is added; lists a value's "
     "``__float__`` changes while they are read, RuntimeError."},
    {NULL},
};

static PyTypeObject WindowType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "agent.step._hot.ShareWindow",
    .tp_doc = PyDoc_STR(
        "ShareWindow(steps, bounds, verdicts)\n--\n\n"
        "Data-wait share of step time over the last ``steps`` optimizer steps, and the "
        "verdict the share reaches: ``verdicts[0]`` below ``bounds[0]``, ``verdicts[1]`` "
        "from it, ``verdicts[2]`` from ``bounds[1]``; the base of "
        ":class:`agent.step.encoder.InputWindow`. The share is the window's waits over its "
        "step times, both summed oldest first at each step (no drift over a long run), in "
        "0 to 1 (0 while the step times' sum is not above 0, or the share is NaN)."),
    .tp_basicsize = sizeof(ShareWindow),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_new = window_new,
    .tp_dealloc = (destructor)window_dealloc,
    .tp_methods = window_methods,
};

/* ------------------------------------------------------------------ StepsBatch */

/* The ``steps`` message's columns, in the message's order: the first ALWAYS_SENT are sent
 * whatever they hold, the others only when a step has a value (a None elsewhere means
 * "absent": agent.wire.protocol), tokens_per_s with tokens. A step's knobs are kept
 * apart: the batch's common value while every step has the same map. */
#define COLUMNS 19
#define ALWAYS_SENT 10
enum {
    C_STEP, C_MICRO_BATCHES, C_SAMPLES, C_STEP_TIME, C_DATA_WAIT, C_SHARE, C_RATE, C_LOSS,
    C_GPU_TIME, C_SKIPPED_TOTAL, C_SKIPPED, C_ACTIVATION, C_TOKENS, C_LR, C_LR_GROUPS,
    C_GRAD_NORM, C_SHARE_WINDOW, C_VERDICT, C_TOKENS_RATE,
};
static const char *const column_names[COLUMNS] = {
    "step", "micro_batches", "samples", "step_time_s", "data_wait_s", "data_wait_share",
    "samples_per_s", "loss", "gpu_step_time_s", "skipped_steps_total",
    "grad_scaler_skipped", "activation_bytes", "tokens", "lr", "lr_groups", "grad_norm",
    "data_wait_share_window", "input_verdict", "tokens_per_s",
};
/* a row as StepEncoder._add_each makes it: which column each of its values goes to
 * (-1: the knobs), the derived ones (share, rates) left out */
#define ROW_VALUES 17
static const int row_columns[ROW_VALUES] = {
    C_STEP, C_MICRO_BATCHES, C_SAMPLES, C_STEP_TIME, C_DATA_WAIT, C_LOSS, C_GPU_TIME, -1,
    C_SKIPPED, C_ACTIVATION, C_TOKENS, C_LR, C_LR_GROUPS, C_GRAD_NORM, C_SKIPPED_TOTAL,
    C_SHARE_WINDOW, C_VERDICT,
};
/* a nesting deeper than this is msgpack's own to pack (and to refuse) */
#define PACK_DEPTH_MAX 32

typedef struct {
    char *data;
    Py_ssize_t len, cap;
} Buffer;

static int
buffer_room(Buffer *buffer, Py_ssize_t more)
{
    if (buffer->len + more <= buffer->cap)
        return 0;
    Py_ssize_t cap = buffer->cap ? buffer->cap : 256;
    while (cap < buffer->len + more)
        cap *= 2;
    char *data = PyMem_Realloc(buffer->data, (size_t)cap);
    if (data == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    buffer->data = data;
    buffer->cap = cap;
    return 0;
}

static inline int
put(Buffer *buffer, const void *bytes, Py_ssize_t size)
{
    if (buffer->len + size > buffer->cap && buffer_room(buffer, size) < 0)
        return -1;
    memcpy(buffer->data + buffer->len, bytes, (size_t)size);
    buffer->len += size;
    return 0;
}

static inline int
put_byte(Buffer *buffer, unsigned char byte)
{
    if (buffer->len + 1 > buffer->cap && buffer_room(buffer, 1) < 0)
        return -1;
    buffer->data[buffer->len++] = (char)byte;
    return 0;
}

/* A marker byte, then ``size`` (1 to 8) bytes of ``value`` big-endian. */
static inline int
put_be(Buffer *buffer, unsigned char marker, unsigned long long value, int size)
{
    if (buffer->len + 9 > buffer->cap && buffer_room(buffer, 9) < 0)
        return -1;
    char *at = buffer->data + buffer->len;
    unsigned long long big = value << (8 * (8 - size));
#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    big = __builtin_bswap64(big);
#endif
    at[0] = (char)marker;
    memcpy(at + 1, &big, 8);  /* (9 bytes of room: the ones past ``size`` are not kept) */
    buffer->len += 1 + size;
    return 0;
}

static inline int
pack_double(Buffer *buffer, double value)
{
    unsigned long long bits;
    memcpy(&bits, &value, sizeof bits);
    return put_be(buffer, 0xcb, bits, 8);
}

/* msgpack's packing of a signed integer (its pack_template.h: the shortest form) */
static int
pack_long_long(Buffer *buffer, long long d)
{
    if (d < -(1LL << 5)) {
        if (d < -(1LL << 15))
            return d < -(1LL << 31) ? put_be(buffer, 0xd3, (unsigned long long)d, 8)
                                    : put_be(buffer, 0xd2, (unsigned long long)d, 4);
        return d < -(1LL << 7) ? put_be(buffer, 0xd1, (unsigned long long)d, 2)
                               : put_be(buffer, 0xd0, (unsigned long long)d, 1);
    }
    if (d < (1LL << 7))
        return put_byte(buffer, (unsigned char)d);  /* (a fixint, negative ones too) */
    if (d < (1LL << 16))
        return d < (1LL << 8) ? put_be(buffer, 0xcc, (unsigned long long)d, 1)
                              : put_be(buffer, 0xcd, (unsigned long long)d, 2);
    return d < (1LL << 32) ? put_be(buffer, 0xce, (unsigned long long)d, 4)
                           : put_be(buffer, 0xcf, (unsigned long long)d, 8);
}

static int
pack_header(Buffer *buffer, Py_ssize_t n, unsigned char fix, unsigned char fix_max,
            unsigned char marker16)
{
    if (n < fix_max)
        return put_byte(buffer, (unsigned char)(fix | n));
    return n < 0x10000 ? put_be(buffer, marker16, (unsigned long long)n, 2)
                       : put_be(buffer, marker16 + 1, (unsigned long long)n, 4);
}
#define pack_array_header(buffer, n) pack_header(buffer, n, 0x90, 16, 0xdc)
#define pack_map_header(buffer, n) pack_header(buffer, n, 0x80, 16, 0xde)

static int
pack_text(Buffer *buffer, const char *text, Py_ssize_t size)
{
    int written;
    if (size < 32)
        written = put_byte(buffer, (unsigned char)(0xa0 | size));
    else if (size < 0x100)
        written = put_be(buffer, 0xd9, (unsigned long long)size, 1);
    else if (size < 0x10000)
        written = put_be(buffer, 0xda, (unsigned long long)size, 2);
    else
        written = put_be(buffer, 0xdb, (unsigned long long)size, 4);
    return written < 0 ? -1 : put(buffer, text, size);
}

/* ``value`` as msgpack.packb(value, use_bin_type=True) packs it, byte for byte: None,
 * bools, ints, floats, strs, lists, tuples and dicts of exactly those types here, any
 * other value (and a nesting past PACK_DEPTH_MAX) by ``packb`` itself. */
static int
pack_object(Buffer *buffer, PyObject *value, PyObject *packb, int depth)
{
    if (value == Py_None)
        return put_byte(buffer, 0xc0);
    if (value == Py_True || value == Py_False)
        return put_byte(buffer, value == Py_True ? 0xc3 : 0xc2);
    if (PyFloat_CheckExact(value))
        return pack_double(buffer, PyFloat_AS_DOUBLE(value));
    if (depth < PACK_DEPTH_MAX) {
        if (PyLong_CheckExact(value)) {
            int overflow;
            long long d = PyLong_AsLongLongAndOverflow(value, &overflow);
            if (!overflow)
                return d == -1 && PyErr_Occurred() ? -1 : pack_long_long(buffer, d);
        }
        else if (PyUnicode_CheckExact(value)) {
            Py_ssize_t size;
            const char *text = PyUnicode_AsUTF8AndSize(value, &size);
            if (text != NULL)
                return pack_text(buffer, text, size);
            PyErr_Clear();  /* (e.g. a lone surrogate: msgpack's error is said below) */
        }
        else if (PyList_CheckExact(value) || PyTuple_CheckExact(value)) {
            Py_ssize_t n = PySequence_Fast_GET_SIZE(value);
            if (pack_array_header(buffer, n) < 0)
                return -1;
            for (Py_ssize_t i = 0; i < n; i++) {
                if (PySequence_Fast_GET_SIZE(value) != n) {
                    PyErr_SetString(PyExc_RuntimeError, "a list changed size while packed");
                    return -1;
                }
                PyObject *item = Py_NewRef(PySequence_Fast_GET_ITEM(value, i));
                int packed = pack_object(buffer, item, packb, depth + 1);
                Py_DECREF(item);
                if (packed < 0)
                    return -1;
            }
            return 0;
        }
        else if (PyDict_CheckExact(value)) {
            Py_ssize_t n = PyDict_GET_SIZE(value), position = 0;
            PyObject *key, *item;
            if (pack_map_header(buffer, n) < 0)
                return -1;
            while (PyDict_Next(value, &position, &key, &item)) {
                Py_INCREF(key);
                Py_INCREF(item);
                int packed = pack_object(buffer, key, packb, depth + 1) < 0
                             || pack_object(buffer, item, packb, depth + 1) < 0 ? -1 : 0;
                Py_DECREF(key);
                Py_DECREF(item);
                if (packed < 0)
                    return -1;
                if (PyDict_GET_SIZE(value) != n) {
                    PyErr_SetString(PyExc_RuntimeError, "a dict changed size while packed");
                    return -1;
                }
            }
            return 0;
        }
    }
    PyObject *packed = PyObject_CallOneArg(packb, value);
    if (packed == NULL)
        return -1;
    if (!PyBytes_Check(packed)) {
        PyErr_SetString(PyExc_TypeError, "packb returned no bytes");
        Py_DECREF(packed);
        return -1;
    }
    int written = put(buffer, PyBytes_AS_STRING(packed), PyBytes_GET_SIZE(packed));
    Py_DECREF(packed);
    return written;
}

typedef struct {
    PyObject_HEAD
    PyObject *packb;           /* msgpack.packb(value, use_bin_type=True): what C does not pack */
    Py_ssize_t n;              /* steps held */
    Buffer columns[COLUMNS];   /* each column's values, packed */
    char present[COLUMNS];     /* a value other than None seen (a column sent only if so) */
    PyObject *knobs;           /* each step's knob values (a list) */
    PyObject *plain;           /* a value's plain form, packed, when packb refuses it (or NULL) */
    PyObject *error;           /* packb's refusal of a value held as its plain form (or NULL):
                                * take raises it */
    char busy;                 /* in an add or take: a call back into the batch is refused */
} StepsBatch;

static PyObject *
batch_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"packb", "plain", NULL};
    PyObject *packb, *plain = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|O:StepsBatch", keywords, &packb, &plain))
        return NULL;
    if (!PyCallable_Check(packb) || (plain != Py_None && !PyCallable_Check(plain))) {
        PyErr_SetString(PyExc_TypeError, "StepsBatch(packb, plain=None): packb and plain "
                        "must be callable");
        return NULL;
    }
    StepsBatch *self = (StepsBatch *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->packb = Py_NewRef(packb);
    self->plain = plain == Py_None ? NULL : Py_NewRef(plain);
    if ((self->knobs = PyList_New(0)) == NULL) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static void
batch_dealloc(StepsBatch *self)
{
    for (int j = 0; j < COLUMNS; j++)
        PyMem_Free(self->columns[j].data);
    Py_XDECREF(self->packb);
    Py_XDECREF(self->knobs);
    Py_XDECREF(self->plain);
    Py_XDECREF(self->error);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* The batch as it was (``lengths``, ``present``, ``n``), after a failed addition: a run
 * is added whole or not at all. */
typedef struct {
    Py_ssize_t lengths[COLUMNS], n;
    char present[COLUMNS];
    int error;  /* (whether a refusal was held) */
} Mark;

static void
batch_mark(StepsBatch *self, Mark *mark)
{
    for (int j = 0; j < COLUMNS; j++)
        mark->lengths[j] = self->columns[j].len;
    memcpy(mark->present, self->present, sizeof mark->present);
    mark->n = self->n;
    mark->error = self->error != NULL;
}

static void
batch_back(StepsBatch *self, Mark *mark)
{
    for (int j = 0; j < COLUMNS; j++)
        self->columns[j].len = mark->lengths[j];
    memcpy(self->present, mark->present, sizeof mark->present);
    self->n = mark->n;
    if (!mark->error)
        Py_CLEAR(self->error);
    PyObject *type, *value, *traceback;  /* (an error being raised is kept) */
    PyErr_Fetch(&type, &value, &traceback);
    if (PyList_SetSlice(self->knobs, mark->n, PyList_GET_SIZE(self->knobs), NULL) < 0)
        PyErr_Clear();
    PyErr_Restore(type, value, traceback);
}

/* Refuse a call back into the batch while it adds or takes (a value's Python code, another
 * thread while the GIL is let go): -1 with RuntimeError. */
static int
batch_enter(StepsBatch *self)
{
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "StepsBatch: in use (a call back into it while "
                        "it adds or takes steps)");
        return -1;
    }
    self->busy = 1;
    return 0;
}

static int
batch_put(StepsBatch *self, int column, PyObject *value)
{
    if (value != Py_None)
        self->present[column] = 1;
    Buffer *buffer = &self->columns[column];
    Py_ssize_t len = buffer->len;
    if (pack_object(buffer, value, self->packb, 0) == 0)
        return 0;
    /* a value msgpack refuses (a numpy or torch number, an int past 64 bits): held as its
     * plain form (the run log's), the refusal kept for take to raise */
    if (self->plain == NULL || !(PyErr_ExceptionMatches(PyExc_TypeError)
                                 || PyErr_ExceptionMatches(PyExc_OverflowError)
                                 || PyErr_ExceptionMatches(PyExc_ValueError)))
        return -1;
    buffer->len = len;
    PyObject *type, *error, *traceback;
    PyErr_Fetch(&type, &error, &traceback);
    PyErr_NormalizeException(&type, &error, &traceback);
    if (traceback != NULL && error != NULL)
        PyException_SetTraceback(error, traceback);
    Py_XDECREF(type);
    Py_XDECREF(traceback);
    if (error == NULL)
        return -1;
    PyObject *packed = PyObject_CallOneArg(self->plain, value);
    if (packed == NULL || !PyBytes_Check(packed)) {
        if (packed != NULL)
            PyErr_SetString(PyExc_TypeError, "plain returned no bytes");
        Py_XDECREF(packed);
        Py_DECREF(error);
        return -1;
    }
    int written = put(buffer, PyBytes_AS_STRING(packed), PyBytes_GET_SIZE(packed));
    Py_DECREF(packed);
    if (written == 0 && self->error == NULL)
        self->error = error;
    else
        Py_DECREF(error);
    return written;
}

static int
batch_put_double(StepsBatch *self, int column, double value)
{
    self->present[column] = 1;
    return pack_double(&self->columns[column], value);
}

/* ``a / b`` as Python divides them, into ``column`` (min(1.0, a / b) where ``capped``):
 * a float or int over a float or int in C, as Python would (doubles; two ints
 * are Python's to divide: it rounds once), anything else by Python. */
static int
batch_put_ratio(StepsBatch *self, int column, PyObject *a, PyObject *b, int capped)
{
    if ((PyFloat_CheckExact(a) || PyLong_CheckExact(a))
            && (PyFloat_CheckExact(b) || PyLong_CheckExact(b))
            && !(PyLong_CheckExact(a) && PyLong_CheckExact(b))) {
        double x = PyFloat_AsDouble(a), y;
        if (x == -1.0 && PyErr_Occurred())
            return -1;
        y = PyFloat_AsDouble(b);
        if (y == -1.0 && PyErr_Occurred())
            return -1;
        if (y == 0.0) {
            PyErr_SetString(PyExc_ZeroDivisionError, "float division by zero");
            return -1;
        }
        double ratio = x / y;
        return batch_put_double(self, column, capped && !(ratio < 1.0) ? 1.0 : ratio);
    }
    PyObject *ratio = PyNumber_TrueDivide(a, b);
    if (ratio == NULL)
        return -1;
    if (capped) {
        PyObject *cap = PyFloat_FromDouble(1.0);
        int less = cap == NULL ? -1 : PyObject_RichCompareBool(ratio, cap, Py_LT);
        if (less <= 0)
            Py_SETREF(ratio, cap == NULL ? NULL : Py_NewRef(cap));  /* (min(1.0, ratio)) */
        Py_XDECREF(cap);
        if (less < 0 || ratio == NULL) {
            Py_XDECREF(ratio);
            return -1;
        }
    }
    int written = batch_put(self, column, ratio);
    Py_DECREF(ratio);
    return written;
}

/* The derived columns of one step: its data-wait share and rates (None untimed). */
static int
batch_put_derived(StepsBatch *self, PyObject *samples, PyObject *time_s, PyObject *wait_s,
                  PyObject *tokens)
{
    int timed = PyObject_IsTrue(time_s);
    if (timed < 0)
        return -1;
    if (!timed)
        return batch_put(self, C_SHARE, Py_None) < 0
               || batch_put(self, C_RATE, Py_None) < 0
               || batch_put(self, C_TOKENS_RATE, Py_None) < 0 ? -1 : 0;
    return batch_put_ratio(self, C_SHARE, wait_s, time_s, 1) < 0
           || batch_put_ratio(self, C_RATE, samples, time_s, 0) < 0
           || (tokens == Py_None ? batch_put(self, C_TOKENS_RATE, Py_None)
                                 : batch_put_ratio(self, C_TOKENS_RATE, tokens, time_s, 0)) < 0
           ? -1 : 0;
}

static PyObject *
batch_add_rows(StepsBatch *self, PyObject *rows)
{
    if (!PyTuple_Check(rows) || PyTuple_GET_SIZE(rows) != ROW_VALUES) {
        PyErr_Format(PyExc_TypeError, "add_rows(columns): a tuple of %d lists", ROW_VALUES);
        return NULL;
    }
    PyObject *lists[ROW_VALUES];
    Py_ssize_t n = -1;
    for (int k = 0; k < ROW_VALUES; k++) {
        lists[k] = PyTuple_GET_ITEM(rows, k);
        if (!PyList_Check(lists[k]) || (n >= 0 && PyList_GET_SIZE(lists[k]) != n)) {
            PyErr_SetString(PyExc_TypeError, "add_rows(columns): lists of one length");
            return NULL;
        }
        n = PyList_GET_SIZE(lists[k]);
    }
    if (batch_enter(self) < 0)
        return NULL;
    Mark mark;
    batch_mark(self, &mark);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *row[ROW_VALUES];
        for (int k = 0; k < ROW_VALUES; k++) {
            if (PyList_GET_SIZE(lists[k]) != n) {
                PyErr_SetString(PyExc_RuntimeError, "add_rows: a list changed size");
                goto failed;
            }
            row[k] = PyList_GET_ITEM(lists[k], i);
        }
        for (int k = 0; k < ROW_VALUES; k++)
            Py_INCREF(row[k]);
        int failed = 0;
        for (int k = 0; k < ROW_VALUES && !failed; k++)
            failed = row_columns[k] < 0 ? PyList_Append(self->knobs, row[k])
                                        : batch_put(self, row_columns[k], row[k]);
        if (!failed)
            failed = batch_put_derived(self, row[2], row[3], row[4], row[10]);
        for (int k = 0; k < ROW_VALUES; k++)
            Py_DECREF(row[k]);
        if (failed)
            goto failed;
        self->n++;
    }
    self->busy = 0;
    Py_RETURN_NONE;
failed:
    batch_back(self, &mark);
    self->busy = 0;
    return NULL;
}

/* A run's field ``index`` of record ``r`` (a borrowed reference). */
#define FIELD(r, index) (((Record *)(r))->values[index])

/* A plain number of a step, read once: None, an int msgpack packs (``i``; past 2**63 - 1
 * its bits, as UINT), or a float. */
enum { NONE, INT, UINT, FLOAT };
typedef struct {
    int kind;
    long long i;
    double d;
} Number;

#define ALLOW_NONE 1
#define ALLOW_INT 2
#define ALLOW_FLOAT 4

/* Whether ``value`` is a plain number ``allow`` lets in: 1 with it in *number; 0 (no
 * error set) for anything else. Reads exact ints and floats only: no Python code. */
static int
read_number(PyObject *value, int allow, Number *number)
{
    if (value == Py_None) {
        number->kind = NONE;
        return (allow & ALLOW_NONE) != 0;
    }
    if (PyFloat_CheckExact(value)) {
        number->kind = FLOAT;
        number->d = PyFloat_AS_DOUBLE(value);
        return (allow & ALLOW_FLOAT) != 0;
    }
    if (!(allow & ALLOW_INT) || !PyLong_CheckExact(value))
        return 0;
    int overflow;
    number->i = PyLong_AsLongLongAndOverflow(value, &overflow);
    number->kind = INT;
    if (overflow > 0) {  /* (2**63 to 2**64 - 1: msgpack's uint 64) */
        unsigned long long big = PyLong_AsUnsignedLongLong(value);
        number->i = (long long)big;
        number->kind = UINT;
        overflow = big == (unsigned long long)-1 && PyErr_Occurred() ? -1 : 0;
    }
    if (overflow || (number->i == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return 0;
    }
    number->d = number->kind == UINT ? (double)(unsigned long long)number->i
                                     : (double)number->i;  /* (as Python's int / float) */
    return 1;
}

static int
batch_put_number(StepsBatch *self, int column, const Number *number)
{
    Buffer *buffer = &self->columns[column];
    if (number->kind == NONE)
        return put_byte(buffer, 0xc0);
    self->present[column] = 1;
    if (number->kind == FLOAT)
        return pack_double(buffer, number->d);
    if (number->kind == UINT)
        return put_be(buffer, 0xcf, (unsigned long long)number->i, 8);
    return pack_long_long(buffer, number->i);
}

/* ``a / b`` (b a nonzero float) into ``column``, min(1.0, a / b) where ``capped``. */
static int
batch_put_quotient(StepsBatch *self, int column, double a, double b, int capped)
{
    double ratio = a / b;
    return batch_put_double(self, column, capped && !(ratio < 1.0) ? 1.0 : ratio);
}

static PyObject *
batch_add_run(StepsBatch *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6 || !PyList_Check(args[0]) || !PyList_Check(args[1])
            || !PyList_Check(args[2]) || !PyList_Check(args[3])
            || !PyObject_TypeCheck(args[4], &WindowType)) {
        PyErr_SetString(PyExc_TypeError, "add_run(records, losses, grad_norms, gpu_times, "
                        "window, skipped_total)");
        return NULL;
    }
    PyObject *run = args[0], *losses = args[1], *grad_norms = args[2], *gpu_times = args[3];
    ShareWindow *window = (ShareWindow *)args[4];
    Py_ssize_t n = PyList_GET_SIZE(run);
    if (n == 0 || PyList_GET_SIZE(losses) != n || PyList_GET_SIZE(grad_norms) != n
            || PyList_GET_SIZE(gpu_times) != n) {
        PyErr_SetString(PyExc_ValueError, "add_run: a run of records and three lists of "
                        "its length");
        return NULL;
    }
    Number skipped_total;
    if (!read_number(args[5], ALLOW_INT, &skipped_total))
        Py_RETURN_NONE;
    /* each timed step's (wait, time), added to the window once the whole run is taken */
    double *timed = PyMem_Malloc(2 * (size_t)n * sizeof(double));
    if (timed == NULL)
        return PyErr_NoMemory();
    if (batch_enter(self) < 0) {
        PyMem_Free(timed);
        return NULL;
    }
    /* One pass: each value read once (exact ints and floats only: no Python code runs, so
     * the records and lists stay as read) and packed; a value it does not take puts the
     * batch back as it was and leaves the run to the caller. */
    Mark mark;
    batch_mark(self, &mark);
    long long first = 0;
    PyObject *last_time = NULL, *result = NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *record = PyList_GET_ITEM(run, i);
        if (!Py_IS_TYPE(record, &RecordType))
            goto refused;
        for (int f = 0; f < FIELDS; f++)
            if (FIELD(record, f) == NULL)  /* (a field deleted) */
                goto refused;
        Number step, micro_batches, samples, wait, time, activation, tokens, lr, loss, norm,
               gpu_time;
        if (!read_number(FIELD(record, STEP), ALLOW_INT, &step) || step.kind != INT
                || (i == 0 ? (first = step.i, 0)  /* (consecutive; unsigned: no overflow) */
                           : (unsigned long long)step.i != (unsigned long long)first + i)
                || !read_number(FIELD(record, MICRO_BATCHES), ALLOW_INT, &micro_batches)
                || !read_number(FIELD(record, 1), ALLOW_INT, &samples)
                || !read_number(FIELD(record, 2), ALLOW_INT | ALLOW_FLOAT, &wait)
                || !read_number(FIELD(record, STEP_TIME_S), ALLOW_NONE | ALLOW_FLOAT, &time)
                || !read_number(FIELD(record, 5), ALLOW_NONE | ALLOW_INT, &activation)
                || !read_number(FIELD(record, 6), ALLOW_NONE | ALLOW_INT, &tokens)
                || !read_number(FIELD(record, 7), ALLOW_NONE | ALLOW_FLOAT, &lr)
                || !read_number(PyList_GET_ITEM(losses, i), ALLOW_NONE | ALLOW_INT | ALLOW_FLOAT,
                                &loss)
                || !read_number(PyList_GET_ITEM(grad_norms, i),
                                ALLOW_NONE | ALLOW_INT | ALLOW_FLOAT, &norm)
                || !read_number(PyList_GET_ITEM(gpu_times, i),
                                ALLOW_NONE | ALLOW_INT | ALLOW_FLOAT, &gpu_time))
            goto refused;
        int is_timed = time.kind == FLOAT && time.d != 0.0;  /* (truthy, as Python's if) */
        if (PyList_Append(self->knobs, FIELD(record, KNOBS)) < 0
                || batch_put_number(self, C_STEP, &step) < 0
                || batch_put_number(self, C_MICRO_BATCHES, &micro_batches) < 0
                || batch_put_number(self, C_SAMPLES, &samples) < 0
                || batch_put_number(self, C_STEP_TIME, &time) < 0
                || batch_put_number(self, C_DATA_WAIT, &wait) < 0
                || batch_put_number(self, C_LOSS, &loss) < 0
                || batch_put_number(self, C_GPU_TIME, &gpu_time) < 0
                || batch_put_number(self, C_SKIPPED_TOTAL, &skipped_total) < 0
                || put_byte(&self->columns[C_SKIPPED], 0xc0) < 0
                || batch_put_number(self, C_ACTIVATION, &activation) < 0
                || batch_put_number(self, C_TOKENS, &tokens) < 0
                || batch_put_number(self, C_LR, &lr) < 0
                || put_byte(&self->columns[C_LR_GROUPS], 0xc0) < 0
                || batch_put_number(self, C_GRAD_NORM, &norm) < 0)
            goto failed;
        if (is_timed) {
            timed[2 * i] = wait.d;
            timed[2 * i + 1] = time.d;
            last_time = FIELD(record, STEP_TIME_S);
            if (batch_put_quotient(self, C_SHARE, wait.d, time.d, 1) < 0
                    || batch_put_quotient(self, C_RATE, samples.d, time.d, 0) < 0
                    || (tokens.kind == NONE
                        ? put_byte(&self->columns[C_TOKENS_RATE], 0xc0)
                        : batch_put_quotient(self, C_TOKENS_RATE, tokens.d, time.d, 0)) < 0)
                goto failed;
        }
        else {
            timed[2 * i + 1] = 0.0;
            if (put_byte(&self->columns[C_SHARE], 0xc0) < 0
                    || put_byte(&self->columns[C_RATE], 0xc0) < 0
                    || put_byte(&self->columns[C_TOKENS_RATE], 0xc0) < 0)
                goto failed;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {  /* the window, now that the run is the batch's */
        if (timed[2 * i + 1] != 0.0) {
            int verdict;
            double share = window_add(window, timed[2 * i], timed[2 * i + 1], &verdict);
            if (batch_put_double(self, C_SHARE_WINDOW, share) < 0
                    || batch_put(self, C_VERDICT, window->verdicts[verdict]) < 0)
                goto failed;
        }
        else if (put_byte(&self->columns[C_SHARE_WINDOW], 0xc0) < 0
                 || put_byte(&self->columns[C_VERDICT], 0xc0) < 0)
            goto failed;
    }
    self->n += n;
    result = Py_BuildValue("(LLO)", first, first + (n - 1), last_time ? last_time : Py_None);
    if (result != NULL)
        goto done;
failed:
    batch_back(self, &mark);
    goto done;
refused:  /* (not taken: no error, the run is the caller's, the batch as it was) */
    batch_back(self, &mark);
    result = Py_NewRef(Py_None);
done:
    self->busy = 0;
    PyMem_Free(timed);
    return result;
}

/* Whether every step's knobs are the first step's (equal maps: Python's ==). */
static int
batch_knobs_same(StepsBatch *self)
{
    Py_ssize_t n = PyList_GET_SIZE(self->knobs);
    PyObject *first = n ? PyList_GET_ITEM(self->knobs, 0) : NULL;
    for (Py_ssize_t i = 1; i < n; i++) {
        PyObject *knobs = PyList_GET_ITEM(self->knobs, i);
        if (knobs == first)
            continue;
        int same = PyObject_RichCompareBool(knobs, first, Py_EQ);
        if (same <= 0)
            return same;
    }
    return 1;
}

static PyObject *
batch_clear(StepsBatch *self, PyObject *unused)
{
    if (batch_enter(self) < 0)
        return NULL;
    Mark empty = {{0}, 0, {0}, 0};
    batch_back(self, &empty);
    self->busy = 0;
    Py_RETURN_NONE;
}

/* A dict's entries (its header written already), each held while packed; RuntimeError
 * where packing one changed the dict's size (the header would not be its). */
static int
pack_entries(Buffer *out, PyObject *dict, PyObject *packb)
{
    Py_ssize_t n = PyDict_GET_SIZE(dict), position = 0;
    PyObject *key, *value;
    while (PyDict_Next(dict, &position, &key, &value)) {
        Py_INCREF(key);
        Py_INCREF(value);
        int packed = pack_object(out, key, packb, 0) < 0
                     || pack_object(out, value, packb, 0) < 0 ? -1 : 0;
        Py_DECREF(key);
        Py_DECREF(value);
        if (packed < 0)
            return -1;
        if (PyDict_GET_SIZE(dict) != n) {
            PyErr_SetString(PyExc_RuntimeError, "a dict changed size while packed");
            return -1;
        }
    }
    return 0;
}

static PyObject *
batch_take(StepsBatch *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyDict_CheckExact(args[0]) || !PyDict_CheckExact(args[1])) {
        PyErr_SetString(PyExc_TypeError, "take(head: dict, common: dict)");
        return NULL;
    }
    PyObject *head = args[0], *common = args[1];
    if (PyDict_GetItemString(head, "body") != NULL) {
        PyErr_SetString(PyExc_ValueError, "take: the head has a body already");
        return NULL;
    }
    if (self->error != NULL) {  /* a value msgpack refused: held as its plain form */
        PyErr_SetObject((PyObject *)Py_TYPE(self->error), self->error);
        return NULL;
    }
    if (batch_enter(self) < 0)
        return NULL;
    int same = batch_knobs_same(self);
    if (same < 0) {
        self->busy = 0;
        return NULL;
    }
    Buffer out = {NULL, 0, 0};
    PyObject *packb = self->packb;
    Py_ssize_t n = self->n, sent = 0;
    for (int j = 0; j < COLUMNS; j++)
        sent += j < ALWAYS_SENT || (j == C_TOKENS_RATE ? self->present[C_TOKENS]
                                                       : self->present[j]);
    Py_ssize_t bytes = 64;
    for (int j = 0; j < COLUMNS; j++)
        bytes += self->columns[j].len + 32;
    if (buffer_room(&out, bytes) < 0
            || pack_map_header(&out, PyDict_GET_SIZE(head) + 1) < 0)
        goto failed;
    if (pack_entries(&out, head, packb) < 0 || pack_text(&out, "body", 4) < 0
            || pack_map_header(&out, 3) < 0
            || pack_text(&out, "n", 1) < 0 || pack_long_long(&out, n) < 0
            || pack_text(&out, "columns", 7) < 0
            || pack_map_header(&out, sent + (n && !same)) < 0)
        goto failed;
    for (int j = 0; j < COLUMNS; j++) {
        if (!(j < ALWAYS_SENT || (j == C_TOKENS_RATE ? self->present[C_TOKENS]
                                                     : self->present[j])))
            continue;
        const char *name = column_names[j];
        if (pack_text(&out, name, (Py_ssize_t)strlen(name)) < 0
                || pack_array_header(&out, n) < 0
                || put(&out, self->columns[j].data, self->columns[j].len) < 0)
            goto failed;
    }
    if (n && !same && (pack_text(&out, "knobs", 5) < 0
                       || pack_object(&out, self->knobs, packb, 0) < 0))
        goto failed;
    if (pack_text(&out, "common", 6) < 0
            || pack_map_header(&out, PyDict_GET_SIZE(common) + (n && same)) < 0)
        goto failed;
    if (pack_entries(&out, common, packb) < 0)
        goto failed;
    if (n && same && (pack_text(&out, "knobs", 5) < 0
                      || pack_object(&out, PyList_GET_ITEM(self->knobs, 0), packb, 0) < 0))
        goto failed;
    PyObject *payload = PyBytes_FromStringAndSize(out.data, out.len);
    PyMem_Free(out.data);
    if (payload != NULL) {
        Mark empty = {{0}, 0, {0}, 0};
        batch_back(self, &empty);
    }
    self->busy = 0;
    return payload;
failed:
    PyMem_Free(out.data);
    self->busy = 0;
    return NULL;
}

static PyObject *
batch_packed_columns(StepsBatch *self, PyObject *unused)
{
    PyObject *columns = PyDict_New();
    if (columns == NULL)
        return NULL;
    for (int j = 0; j < COLUMNS; j++) {
        if (!(j < ALWAYS_SENT || (j == C_TOKENS_RATE ? self->present[C_TOKENS]
                                                     : self->present[j])))
            continue;
        Buffer column = {NULL, 0, 0};
        PyObject *packed = NULL;
        if (pack_array_header(&column, self->n) == 0
                && put(&column, self->columns[j].data, self->columns[j].len) == 0)
            packed = PyBytes_FromStringAndSize(column.data, column.len);
        PyMem_Free(column.data);
        if (packed == NULL || PyDict_SetItemString(columns, column_names[j], packed) < 0) {
            Py_XDECREF(packed);
            Py_DECREF(columns);
            return NULL;
        }
        Py_DECREF(packed);
    }
    PyObject *knobs = PyList_GetSlice(self->knobs, 0, PyList_GET_SIZE(self->knobs));
    if (knobs == NULL) {
        Py_DECREF(columns);
        return NULL;
    }
    return Py_BuildValue("(NN)", columns, knobs);
}

static PyObject *
batch_get_n(StepsBatch *self, void *closure)
{
    return PyLong_FromSsize_t(self->n);
}

static PyMethodDef batch_methods[] = {
    {"add_rows", (PyCFunction)batch_add_rows, METH_O,
     "add_rows(columns)\n--\n\n"
     "Add steps given as the tuple of 17 lists of one length a row of "
     ":meth:`agent.step.encoder.StepEncoder._add_each` makes (column ``k`` holds each "
     "step's ``k``-th value); their data-wait share and rates are derived here. All or "
     "none: an error (a value msgpack cannot pack, a share of values that do not divide) "
     "leaves the batch as it was."},
    {"add_run", (PyCFunction)(void (*)(void))batch_add_run, METH_FASTCALL,
     "add_run(records, losses, grad_norms, gpu_times, window, skipped_total)\n--\n\n"
     "Add a run of step records whose values are the usual ones, read from the records "
     "themselves (no list a field), each timed step added to ``window`` (a "
     "ShareWindow); the losses, gradient norms and GPU step times are lists of the "
     "run's length, ``skipped_total`` every step's (plain numbers only: nothing runs "
     "Python code while a run is added). Returns ``(first_step, last_step, "
     "last_step_time_s)`` (the last truthy step time, or None), or None, having "
     "touched nothing, for a run it does not take: steps that are not consecutive "
     "ints, a field that is not a plain number or None (an ``lr`` of param groups), a "
     "record that is not a StepRecord. The caller adds such a run with :meth:`add_rows`."},
    {"take", (PyCFunction)(void (*)(void))batch_take, METH_FASTCALL,
     "take(head, common)\n--\n\n"
     "The batch as a ``steps`` message, packed, and the batch emptied: the bytes of "
     "``msgpack.packb({**head, 'body': {'n': n, 'columns': columns, 'common': common}}, "
     "use_bin_type=True)``, byte for byte, where ``columns`` are the steps' (those of the "
     "optional fields only when a step has one) and ``knobs`` is in ``common`` (last) "
     "while every step has the same map, else a column (last). ``head`` and ``common`` "
     "are dicts. On an error the batch is kept."},
    {"clear", (PyCFunction)batch_clear, METH_NOARGS, "clear()\n--\n\nEmpty the batch."},
    {"packed_columns", (PyCFunction)batch_packed_columns, METH_NOARGS,
     "packed_columns()\n--\n\n"
     "``(columns, knobs)``: the columns :meth:`take` would send, each as the msgpack "
     "bytes of its list, and every step's knobs (a list): the batch's values when its "
     "message cannot be packed (the run log then keeps them, what msgpack cannot hold "
     "as its repr)."},
    {NULL},
};

static PyGetSetDef batch_getset[] = {
    {"n", (getter)batch_get_n, NULL, "steps held", NULL},
    {NULL},
};

static PyTypeObject BatchType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "agent.step._hot.StepsBatch",
    .tp_doc = PyDoc_STR(
        "StepsBatch(packb, plain=None)\n--\n\n"
        "The steps of one ``steps`` message (agent.wire.protocol), packed as msgpack as "
        "they are added, one buffer a column: no Python list or number a step. "
        "``packb`` is ``msgpack.packb`` with ``use_bin_type=True``, for the values C "
        "does not pack itself (what is not None, a bool, an int of 64 bits, a float, a "
        "str, or a list, tuple or dict of those). ``plain`` (the run log's pack_plain): a value "
        "packb refuses is held as its plain form, and :meth:`take` raises packb's error "
        "(the steps are kept for the log, not dropped). I/O thread only: a call back into "
        "the batch while it adds or takes raises RuntimeError.\n\n"
        ".. note:: In bench_overhead's paced loop the columns built as lists and packed "
        "by msgpack cost the I/O thread about 0.6 us a step (a list and a number object "
        "a value, msgpack's dispatch a value)."),
    .tp_basicsize = sizeof(StepsBatch),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = batch_new,
    .tp_dealloc = (destructor)batch_dealloc,
    .tp_methods = batch_methods,
    .tp_getset = batch_getset,
};

/* ------------------------------------------------------------------ HotPath */

static PyObject *str_mark, *str_mark_read, *str_encoder, *str_overflowing,
    *str_tell_step, *str_apply_pending, *str_report_error, *str_hot_path;

typedef struct {
    PyObject_HEAD
    char broken;                /* _broken */
    char marks_on_host;         /* _marks_on_host: the marker is a CpuMarker */
    Py_ssize_t held_max;        /* _held_max */
    Py_ssize_t queue_size;      /* _queue_size */
    PyObject *last_boundary_t;  /* _last_boundary_t: None or a float */
    PyObject *records;          /* _records: the deque of StepRecords */
    PyObject *records_append;   /* its bound append (no method lookup a step) */
    PyObject *marker;           /* _marker */
    PyObject *knob_values;      /* _knob_values */
    PyObject *last_step;        /* _last_step */
    PyObject *listeners;        /* _listeners: a tuple */
    PyObject *pending;          /* _pending: the desk's list of pending commands */
} Hot;

#define HOT_OBJECTS(X) X(last_boundary_t) X(records) X(records_append) X(marker) X(knob_values) \
    X(last_step) X(listeners) X(pending)

static PyObject *
hot_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    Hot *self = (Hot *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
#define SET_NONE(name) self->name = Py_NewRef(Py_None);
    HOT_OBJECTS(SET_NONE)
#undef SET_NONE
    Py_CLEAR(self->records_append);  /* (set with _records) */
    Py_SETREF(self->last_step, Py_NewRef(zero));
    return (PyObject *)self;
}

static int
hot_traverse(Hot *self, visitproc visit, void *arg)
{
#define VISIT(name) Py_VISIT(self->name);
    HOT_OBJECTS(VISIT)
#undef VISIT
    return 0;
}

static int
hot_clear(Hot *self)
{
#define CLEAR(name) Py_CLEAR(self->name);
    HOT_OBJECTS(CLEAR)
#undef CLEAR
    return 0;
}

static void
hot_dealloc(Hot *self)
{
    PyObject_GC_UnTrack(self);
    hot_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int
call_method(PyObject *target, PyObject *name, PyObject *arg)
{
    PyObject *args[2] = {target, arg};
    PyObject *done = PyObject_VectorcallMethod(
        name, args, (arg == NULL ? 1 : 2) | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    if (done == NULL)
        return -1;
    Py_DECREF(done);
    return 0;
}

/* 1, or 0 with AttributeError where a field was deleted from Python: checked again after
 * each call into Python (a marker's, a listener's may delete any) */
static int
hot_fields_present(Hot *self)
{
    if (!self->last_boundary_t || !self->records_append || !self->marker || !self->knob_values
            || !self->last_step || !self->listeners || !self->pending) {
        PyErr_SetString(PyExc_AttributeError, "a field of the agent's hot path was deleted");
        return 0;
    }
    return 1;
}

static int
hot_step(Hot *self, PyObject *arg)
{
    if (!Py_IS_TYPE(arg, &RecordType)) {
        PyErr_Format(PyExc_TypeError, "optimizer_step needs a StepRecord, got %.100s",
                     Py_TYPE(arg)->tp_name);
        return -1;
    }
    if (!hot_fields_present(self))
        return -1;
    PyObject **values = ((Record *)arg)->values;
    if (!values[LOSS] || !values[SKIPPED] || !values[GRAD_NORM] || !values[STEP]) {
        PyErr_SetString(PyExc_AttributeError, "a field of the StepRecord was deleted");
        return -1;
    }
    double now = now_s();
    PyObject *step_time_s = Py_None;
    if (self->last_boundary_t != Py_None) {
        double previous = PyFloat_AsDouble(self->last_boundary_t);
        if (previous == -1.0 && PyErr_Occurred())
            return -1;
        if ((step_time_s = PyFloat_FromDouble(now - previous)) == NULL)
            return -1;
    }
    else
        Py_INCREF(step_time_s);
    Py_XSETREF(values[STEP_TIME_S], step_time_s);
    PyObject *boundary_t = PyFloat_FromDouble(now);
    if (boundary_t == NULL)
        return -1;
    Py_XSETREF(self->last_boundary_t, boundary_t);

    Py_ssize_t queued = PyObject_Length(self->records);
    if (queued < 0)
        return -1;
    PyObject *marker;
    PyObject *loss_read = NULL, *norm_read = NULL;
    if (self->marks_on_host) {
        /* A host loss (and gradient norm) that can be read from memory is read now, with
           no call: its value is final at the boundary, and the record then holds a number,
           not the tensor with its autograd graph's nodes (held for a publish interval and
           freed on the I/O thread, they cost the model's next steps about 5 us of CPU a
           step on a 240 us step: .probe/hold.py in session 23). */
        double value;
        PyObject *loss = values[LOSS], *norm = values[GRAD_NORM];
        if (loss != Py_None && !PyFloat_CheckExact(loss) && hotpath->host_scalar(loss, &value)) {
            if ((loss_read = PyFloat_FromDouble(value)) == NULL)
                return -1;
            loss = loss_read;
        }
        if (norm != Py_None && !PyFloat_CheckExact(norm) && hotpath->host_scalar(norm, &value)) {
            if ((norm_read = PyFloat_FromDouble(value)) == NULL) {
                Py_XDECREF(loss_read);
                return -1;
            }
            norm = norm_read;
        }
        if (queued < self->held_max || loss == Py_None || PyFloat_CheckExact(loss))
            marker = host_mark_of(loss, values[SKIPPED], norm);
        else  /* the I/O thread is behind: no more autograd graphs held */
            marker = PyObject_CallMethodObjArgs(self->marker, str_mark_read, loss,
                                                values[SKIPPED], norm, NULL);
        Py_XDECREF(loss_read);
        Py_XDECREF(norm_read);
    }
    else
        marker = PyObject_CallMethodObjArgs(
            self->marker, queued < self->held_max ? str_mark : str_mark_read, values[LOSS],
            values[SKIPPED], values[GRAD_NORM], NULL);
    if (marker != NULL && queued >= self->queue_size) {  /* (this append drops one) */
        PyObject *encoder = PyObject_GetAttr((PyObject *)self, str_encoder);
        int done = encoder == NULL ? -1 : call_method(encoder, str_overflowing, NULL);
        Py_XDECREF(encoder);
        if (done < 0) {
            Py_DECREF(marker);
            return -1;
        }
    }
    if (marker == NULL)
        return -1;
    Py_XSETREF(values[MARKER], marker);
    Py_XSETREF(values[LOSS], Py_NewRef(Py_None));  /* (the marker holds what is read) */
    if (!hot_fields_present(self) || values[STEP] == NULL) {  /* (a marker's Python ran) */
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_AttributeError, "a field of the StepRecord was deleted");
        return -1;
    }
    Py_XSETREF(values[KNOBS], Py_NewRef(self->knob_values));
    PyObject *append = Py_NewRef(self->records_append);
    PyObject *appended = PyObject_CallOneArg(append, arg);
    Py_DECREF(append);
    if (appended == NULL)
        return -1;
    Py_DECREF(appended);
    if (!hot_fields_present(self))
        return -1;
    Py_XSETREF(self->last_step, Py_NewRef(values[STEP]));
    PyObject *listeners = Py_NewRef(self->listeners);
    int telling = PyObject_IsTrue(listeners);
    Py_DECREF(listeners);
    if (telling < 0 || (telling && call_method((PyObject *)self, str_tell_step, arg) < 0))
        return -1;
    if (!hot_fields_present(self))  /* (a listener ran) */
        return -1;
    int pending = PyObject_IsTrue(self->pending);
    if (pending < 0)
        return -1;
    if (pending) {
        PyObject *step = Py_NewRef(self->last_step);
        int done = call_method((PyObject *)self, str_apply_pending, step);
        Py_DECREF(step);
        if (done < 0)
            return -1;
    }
    return 0;
}

static PyObject *
hot_optimizer_step(Hot *self, PyObject *record)
{
    if (self->broken)
        Py_RETURN_NONE;
    if (hot_step(self, record) == 0)
        Py_RETURN_NONE;
    if (!PyErr_ExceptionMatches(PyExc_Exception))
        return NULL;  /* (KeyboardInterrupt, SystemExit: the training's own) */
    /* the first rule: never crash the training */
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyErr_NormalizeException(&type, &value, &traceback);
    if (traceback != NULL)
        PyException_SetTraceback(value, traceback);
    self->broken = 1;
    PyObject *args[3] = {(PyObject *)self, str_hot_path, value};
    PyObject *done = PyObject_VectorcallMethod(str_report_error, args,
                                               3 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(traceback);
    if (done == NULL)
        return NULL;
    Py_DECREF(done);
    Py_RETURN_NONE;
}

static PyObject *
hot_mark_start(Hot *self, PyObject *unused)
{
    PyObject *now = PyFloat_FromDouble(now_s());
    if (now == NULL)
        return NULL;
    Py_SETREF(self->last_boundary_t, now);
    Py_RETURN_NONE;
}

static PyMethodDef hot_methods[] = {
    {"mark_start", (PyCFunction)hot_mark_start, METH_NOARGS,
     "mark_start()\n--\n\nTraining thread: the loop starts now (the first step's time "
     "counts from here), on :meth:`optimizer_step`'s clock."},
    {"optimizer_step", (PyCFunction)hot_optimizer_step, METH_O,
     "optimizer_step(record)\n--\n\n"
     "Training thread: record the optimizer step that ended, then apply the commands due "
     "next.\n\n"
     "The step ``record.step``, which just ended; the commands due at step "
     "``record.step + 1``.\n\n"
     "Args:\n"
     "    record: what the integration measured of the step (see "
     ":class:`agent.step.record.StepRecord`); this fills in its ``step_time_s``, "
     "``marker`` and ``knobs``, sets its ``loss`` to None (the marker holds it) and "
     "queues it (it must not be changed after).\n\n"
     ".. note:: In C (agent/step/_hot.c). Never synchronizes the device and never blocks: "
     "a clock read, a marker (an asynchronous CUDA event on GPU; on the host the loss and "
     "gradient norm: read from memory, no call, when 0-dim float32 or float64, else the "
     "tensor itself, or its value read when "
     ":data:`agent.step.core.LOSSES_HELD_MAX` records are queued), one deque append (and "
     "the calls of :meth:`add_listener`'s listeners, when there are any). Never raises "
     "(but KeyboardInterrupt and SystemExit): an internal error is reported once "
     "(``report_error``) and the agent stops observing."},
    {NULL},
};

static PyMemberDef hot_members[] = {
    {"_broken", T_BOOL, offsetof(Hot, broken), 0, "the agent stopped observing"},
    {"_marks_on_host", T_BOOL, offsetof(Hot, marks_on_host), 0,
     "the marker is a CpuMarker: its mark is made here (host_mark)"},
    {"_held_max", T_PYSSIZET, offsetof(Hot, held_max), 0,
     "records queued past which host losses are read at once"},
    {"_queue_size", T_PYSSIZET, offsetof(Hot, queue_size), 0, "the record queue's bound"},
    {"_last_boundary_t", T_OBJECT_EX, offsetof(Hot, last_boundary_t), 0,
     "the clock at the last boundary (s), or None"},
    {"_marker", T_OBJECT_EX, offsetof(Hot, marker), 0, "the step marker kind"},
    {"_knob_values", T_OBJECT_EX, offsetof(Hot, knob_values), 0,
     "the knob values steps train with now"},
    {"_last_step", T_OBJECT_EX, offsetof(Hot, last_step), 0, "the last step recorded"},
    {"_listeners", T_OBJECT_EX, offsetof(Hot, listeners), 0,
     "the in-process record listeners (a tuple)"},
    {"_pending", T_OBJECT_EX, offsetof(Hot, pending), 0, "the desk's pending commands"},
    {NULL},
};

static PyObject *
hot_get_records(Hot *self, void *closure)
{
    return queue_get(self->records, "_records");
}

static int
hot_set_records(Hot *self, PyObject *value, void *closure)
{
    return queue_set(&self->records, &self->records_append, value);
}

static PyGetSetDef hot_getset[] = {
    {"_records", (getter)hot_get_records, (setter)hot_set_records,
     "the record queue (a deque)", NULL},
    {NULL},
};

static PyTypeObject HotType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "agent.step._hot.HotPath",
    .tp_doc = PyDoc_STR(
        "The agent's training-thread state and its optimizer_step, in C: the base of "
        ":class:`agent.step.core.Agent`, which sets every field in its ``__init__`` and "
        "provides what the rare paths call: ``_tell_step(record)`` (listeners), "
        "``_apply_pending(step)`` (commands), ``_encoder.overflowing()`` (a full queue) "
        "and ``report_error(where, exc)``."),
    .tp_basicsize = sizeof(Hot),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_new = hot_new,
    .tp_traverse = (traverseproc)hot_traverse,
    .tp_clear = (inquiry)hot_clear,
    .tp_dealloc = (destructor)hot_dealloc,
    .tp_methods = hot_methods,
    .tp_members = hot_members,
    .tp_getset = hot_getset,
};


/* ------------------------------------------------------------------ RunPath */

static PyObject *str_window_done, *str_take, *str_take_step, *str_take_window, *str_own_window,
    *str_window_off, *str_next_window, *str_after_boundary,
    *str_micro_batches, *str_skipped, *str_snapshot_steps_left, *str_optimizer_step, *one;

typedef struct {
    PyObject_HEAD
    char broken;              /* broken */
    char pause_requested;     /* _pause_requested */
    char recovering;          /* _recovering */
    char window_of_scaler;    /* _window_of_scaler */
    char next_window_due;     /* _next_window_due */
    PyObject *step;           /* step */
    PyObject *agent;          /* agent */
    PyObject *position;       /* position */
    PyObject *meter;          /* meter */
    PyObject *trained;        /* _micro_batches_trained */
    PyObject *kept;           /* _kept */
    PyObject *lr_back;        /* _lr_back */
    PyObject *event_sources;  /* event_sources */
    PyObject *memory;         /* memory */
    PyObject *optimizer_settings;  /* optimizer_settings */
    PyObject *windows_off;    /* _windows_off */
    PyObject *accum_steps;    /* _accum_steps */
    PyObject *scaler;         /* scaler: a Session's SwitchableGradScaler */
    PyObject *activation_bytes;  /* _activation_bytes: a Session's measurement */
} Run;

#define RUN_OBJECTS(X) X(step) X(agent) X(position) X(meter) X(trained) X(kept) X(lr_back) \
    X(event_sources) X(memory) X(optimizer_settings) X(windows_off) X(accum_steps) X(scaler) \
    X(activation_bytes)

static PyObject *
run_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    Run *self = (Run *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
#define SET_NONE(name) self->name = Py_NewRef(Py_None);
    RUN_OBJECTS(SET_NONE)
#undef SET_NONE
    Py_SETREF(self->step, Py_NewRef(zero));
    Py_SETREF(self->trained, Py_NewRef(zero));
    return (PyObject *)self;
}

static int
run_traverse(Run *self, visitproc visit, void *arg)
{
#define VISIT(name) Py_VISIT(self->name);
    RUN_OBJECTS(VISIT)
#undef VISIT
    return 0;
}

static int
run_clear(Run *self)
{
#define CLEAR(name) Py_CLEAR(self->name);
    RUN_OBJECTS(CLEAR)
#undef CLEAR
    return 0;
}

static void
run_dealloc(Run *self)
{
    PyObject_GC_UnTrack(self);
    run_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* A new reference to the run's field ``value``, or NULL with AttributeError where it was
 * deleted from Python: read again after each call into Python (a hook, a listener may
 * delete or replace any field), and held while it is called or read. */
static PyObject *
run_field(PyObject *value)
{
    if (value == NULL) {
        PyErr_SetString(PyExc_AttributeError, "a field of the run's hot path was deleted");
        return NULL;
    }
    return Py_NewRef(value);
}

static int
run_fields_present(Run *self)
{
#define PRESENT(name) || self->name == NULL
    if (0 RUN_OBJECTS(PRESENT)) {
        PyErr_SetString(PyExc_AttributeError, "a field of the run's hot path was deleted");
        return 0;
    }
#undef PRESENT
    return 1;
}

/* Unpack ``result`` (a new reference, or NULL) into ``n`` new references; -1 on error. */
static int
unpack(PyObject *result, PyObject **out, Py_ssize_t n, const char *what)
{
    if (result == NULL)
        return -1;
    if (!PyTuple_Check(result) || PyTuple_GET_SIZE(result) != n) {
        PyObject *items = PySequence_Tuple(result);
        Py_DECREF(result);
        if (items == NULL)
            return -1;
        if (PyTuple_GET_SIZE(items) != n) {
            PyErr_Format(PyExc_ValueError, "%s gave %zd values, not %zd", what,
                         PyTuple_GET_SIZE(items), n);
            Py_DECREF(items);
            return -1;
        }
        result = items;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        out[i] = Py_NewRef(PyTuple_GET_ITEM(result, i));
    Py_DECREF(result);
    return 0;
}

static PyObject *
call_noargs(PyObject *target, PyObject *name)
{
    PyObject *args[1] = {target};
    return PyObject_VectorcallMethod(name, args, 1 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
}

/* RunBase.boundary's work: 0, or -1 with an exception set. */
static int
run_boundary(Run *self, PyObject *record)
{
    if (self->broken)
        return 0;
    if (!Py_IS_TYPE(record, &RecordType)) {
        PyErr_Format(PyExc_TypeError, "boundary needs a StepRecord, got %.100s",
                     Py_TYPE(record)->tp_name);
        return -1;
    }
    if (!run_fields_present(self))
        return -1;
    PyObject **values = ((Record *)record)->values;
    if (!values[STEP] || !values[MICRO_BATCHES]) {
        PyErr_SetString(PyExc_AttributeError, "a field of the StepRecord was deleted");
        return -1;
    }
    PyObject *value = Py_NewRef(values[STEP]);  /* (held: its __bool__ is Python's) */
    int counted = PyObject_IsTrue(value);
    if (counted < 0) {
        Py_DECREF(value);
        return -1;
    }
    PyObject *step = NULL;
    if (counted)
        step = Py_NewRef(value);
    else {
        PyObject *last = run_field(self->step);
        step = last == NULL ? NULL : PyNumber_Add(last, one);
        Py_XDECREF(last);
    }
    Py_DECREF(value);
    if (step == NULL)
        return -1;
    Py_XSETREF(self->step, Py_NewRef(step));
    Py_XSETREF(values[STEP], step);
    if (values[MICRO_BATCHES] == NULL) {
        PyErr_SetString(PyExc_AttributeError, "a field of the StepRecord was deleted");
        return -1;
    }
    /* (each held across the calls into Python: window_done, __index__, __add__ may delete
     * or replace any run's field or the record's) */
    PyObject *micro_batches = Py_NewRef(values[MICRO_BATCHES]);
    PyObject *position = run_field(self->position);
    int done_position = -1;
    if (position != NULL && PyObject_TypeCheck(position, hotpath->counts_type)) {
        Py_ssize_t count = PyNumber_AsSsize_t(micro_batches, PyExc_OverflowError);
        if (count != -1 || !PyErr_Occurred())  /* (the usual: no lookup, no call) */
            done_position = hotpath->window_done(position, count);
    }
    else if (position != NULL)
        done_position = call_method(position, str_window_done, micro_batches);
    Py_XDECREF(position);
    PyObject *before = done_position < 0 ? NULL : run_field(self->trained);
    PyObject *trained = before == NULL ? NULL : PyNumber_Add(before, micro_batches);
    Py_XDECREF(before);
    Py_DECREF(micro_batches);
    if (trained == NULL)
        return -1;
    Py_XSETREF(self->trained, trained);
    PyObject *agent = run_field(self->agent);  /* (held: a listener may replace it) */
    if (agent == NULL)
        return -1;
    PyObject *done = PyObject_TypeCheck(agent, &HotType)
        ? hot_optimizer_step((Hot *)agent, record)
        : PyObject_CallMethodOneArg(agent, str_optimizer_step, record);
    Py_DECREF(agent);
    if (done == NULL)
        return -1;
    Py_DECREF(done);
    int more = self->pause_requested || self->recovering || self->kept != Py_None
        || self->lr_back != Py_None;
    if (!more && self->event_sources != NULL) {
        PyObject *sources = Py_NewRef(self->event_sources);
        more = PyList_CheckExact(sources)
            ? PyList_GET_SIZE(sources) > 0 : PyObject_IsTrue(sources);
        Py_DECREF(sources);
        if (more < 0) {
            PyErr_Clear();  /* (_after_boundary reads it again, where an error is reported) */
            more = 1;
        }
    }
    if (!more && self->memory != NULL) {
        PyObject *memory = Py_NewRef(self->memory);
        PyObject *left = PyObject_GetAttr(memory, str_snapshot_steps_left);
        Py_DECREF(memory);
        more = left == NULL ? -1 : PyObject_IsTrue(left);
        Py_XDECREF(left);
        if (more < 0) {
            PyErr_Clear();  /* (idem) */
            more = 1;
        }
    }
    if (more) {
        PyObject *after = call_noargs((PyObject *)self, str_after_boundary);
        if (after == NULL)
            return -1;
        Py_DECREF(after);
    }
    return 0;
}

static PyObject *
run_boundary_method(Run *self, PyObject *record)
{
    if (run_boundary(self, record) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* LoopRun.optimizer_step's arguments, in order */
#define STEP_ARGS 6
static const char *const step_arg_names[STEP_ARGS] = {
    "loss", "samples", "tokens", "skipped", "grad_norm", "activation_bytes",
};
static PyObject *step_args[STEP_ARGS];  /* interned */

static int
loop_parse(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, PyObject **given)
{
    if (nargs > STEP_ARGS) {
        PyErr_Format(PyExc_TypeError, "optimizer_step() takes at most %d arguments (%zd "
                     "given)", STEP_ARGS, nargs);
        return -1;
    }
    for (Py_ssize_t i = 0; i < nargs; i++)
        given[i] = args[i];
    Py_ssize_t nkw = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    for (Py_ssize_t k = 0; k < nkw; k++) {
        PyObject *name = PyTuple_GET_ITEM(kwnames, k);
        int found = -1;
        for (int i = 0; i < STEP_ARGS && found < 0; i++)
            if (name == step_args[i])
                found = i;
        for (int i = 0; i < STEP_ARGS && found < 0; i++) {
            int equal = PyUnicode_Compare(name, step_args[i]);
            if (equal == -1 && PyErr_Occurred())
                return -1;
            if (equal == 0)
                found = i;
        }
        if (found < 0) {
            PyErr_Format(PyExc_TypeError, "optimizer_step() got an unexpected keyword "
                         "argument %R", name);
            return -1;
        }
        if (given[found] != NULL) {
            PyErr_Format(PyExc_TypeError, "optimizer_step() got multiple values for "
                         "argument '%s'", step_arg_names[found]);
            return -1;
        }
        given[found] = args[nargs + k];
    }
    return 0;
}

/* ``value`` when given and not None, else ``otherwise`` (borrowed) */
#define OR(value, otherwise) ((value) != NULL && (value) != Py_None ? (value) : (otherwise))

static PyObject *
run_loop_step(Run *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    PyObject *given[STEP_ARGS] = {NULL};
    if (loop_parse(args, PyVectorcall_NARGS(nargsf), kwnames, given) < 0)
        return NULL;
    if (!run_fields_present(self))
        return NULL;
    /* the window: (loss sum, skipped, backward passes, activation bytes) */
    PyObject *window[4] = {NULL}, *taken[4] = {NULL}, *rates[2] = {NULL};
    PyObject *record = NULL, *result = NULL, *target = NULL;
    if (self->window_of_scaler) {  /* Session's: its SwitchableGradScaler's, if it was used */
        window[3] = self->activation_bytes;  /* (its reference moves to the window) */
        self->activation_bytes = Py_NewRef(Py_None);
        PyObject *scaler = target = Py_NewRef(self->scaler);  /* (held: its Python runs) */
        PyObject *used = PyObject_GetAttr(scaler, str_micro_batches);
        int backward = used == NULL ? -1 : PyObject_IsTrue(used);
        Py_XDECREF(used);
        PyObject *skipped = backward ? NULL : PyObject_GetAttr(scaler, str_skipped);
        if (backward < 0 || (!backward && skipped == NULL))
            goto done;
        if (backward || skipped != Py_None) {
            Py_XDECREF(skipped);
            if (unpack(call_noargs(scaler, str_take_window), window, 3,
                       "the scaler's take_window()") < 0)
                goto done;
        }
        else {
            Py_DECREF(skipped);
            window[0] = Py_NewRef(Py_None);
            window[1] = Py_NewRef(Py_None);
            window[2] = Py_NewRef(zero);
        }
        Py_CLEAR(target);
    }
    else if (unpack(call_noargs((PyObject *)self, str_own_window), window, 4,
                    "_take_window()") < 0)
        goto done;
    /* (each field read again after a call into Python, and held while it is called: a
     * hook may delete or replace any of them) */
    if ((target = run_field(self->meter)) == NULL)
        goto done;
    if (Py_IS_TYPE(target, hotpath->meter_type)) {  /* (the usual: no lookup, no Python) */
        double data_wait_s;
        Py_ssize_t fetched, samples;
        if (hotpath->meter_take(target, &data_wait_s, &fetched, &samples, &taken[3]) < 0
                || (taken[0] = PyFloat_FromDouble(data_wait_s)) == NULL
                || (taken[1] = PyLong_FromSsize_t(fetched)) == NULL
                || (taken[2] = PyLong_FromSsize_t(samples)) == NULL)
            goto done;
    }
    else if (unpack(call_noargs(target, str_take), taken, 4, "the meter's take()") < 0)
        goto done;
    Py_CLEAR(target);
    /* taken: (data wait, micro-batches fetched, samples, tokens) */
    if ((target = run_field(self->optimizer_settings)) == NULL)
        goto done;
    if (target == Py_None) {
        rates[0] = Py_NewRef(Py_None);
        rates[1] = Py_NewRef(Py_None);
    }
    else if (unpack(call_noargs(target, str_take_step), rates, 2, "take_step()") < 0)
        goto done;
    Py_CLEAR(target);
    int backward = PyObject_IsTrue(window[2]);
    if (backward < 0)
        goto done;
    PyObject *counted = backward ? window[2] : taken[1];
    if ((target = run_field(self->windows_off)) == NULL)
        goto done;
    if (target != Py_None) {
        Py_CLEAR(target);
        int some = PyObject_IsTrue(counted);
        if (some < 0)
            goto done;
        if (some) {
            if ((target = run_field(self->accum_steps)) == NULL)
                goto done;
            int equal = PyObject_RichCompareBool(counted, target, Py_EQ);
            Py_CLEAR(target);
            if (equal < 0
                    || (!equal && call_method((PyObject *)self, str_window_off, counted) < 0))
                goto done;
            if (equal)
                Py_XSETREF(self->windows_off, Py_NewRef(zero));
        }
    }
    Py_CLEAR(target);
    int fetched = backward ? 1 : PyObject_IsTrue(taken[1]);
    if (fetched < 0)
        goto done;
    PyObject *fields[9] = {
        backward ? window[2] : fetched ? taken[1] : one,  /* micro_batches */
        OR(given[1], taken[2]),  /* samples */
        taken[0],  /* data_wait_s */
        OR(given[0], window[0]),  /* loss */
        OR(given[3], window[1]),  /* skipped */
        OR(given[5], window[3]),  /* activation_bytes */
        OR(given[2], taken[3]),  /* tokens */
        rates[0],  /* lr */
        OR(given[4], rates[1]),  /* grad_norm */
    };
    record = record_make(&RecordType, fields, 9, NULL, NULL, 0);
    if (record == NULL || run_boundary(self, record) < 0)
        goto done;
    if (self->next_window_due) {
        PyObject *next = call_noargs((PyObject *)self, str_next_window);
        if (next == NULL)
            goto done;
        Py_DECREF(next);
    }
    result = Py_NewRef(Py_None);
done:
    for (int i = 0; i < 4; i++) {
        Py_XDECREF(window[i]);
        Py_XDECREF(taken[i]);
    }
    Py_XDECREF(rates[0]);
    Py_XDECREF(rates[1]);
    Py_XDECREF(target);
    Py_XDECREF(record);
    return result;
}

static PyMethodDef run_methods[] = {
    {"boundary", (PyCFunction)run_boundary_method, METH_O,
     "boundary(record)\n--\n\n"
     "Training thread, at an optimizer-step boundary: count, record and publish the step.\n\n"
     "After ``step()`` and ``zero_grad``: count the step (``record.step``: the framework's "
     "own count, when it keeps one; else :attr:`step` + 1), note its window in the data "
     "position, record it (:meth:`agent.step.core.Agent.optimizer_step`, called in C: "
     "an override of it in a subclass of the agent is not called) and apply the "
     "commands due (a checkpoint among them holds this step), then, when there is any "
     "(``_after_boundary``): hold a pause, end a rollback's watch, take a recovery's step, "
     "publish the event sources' events and tick the memory knobs.\n\n"
     "Raises:\n"
     "    TypeError: ``record`` is not a StepRecord.\n\n"
     ".. note:: In C (agent/step/_hot.c). Never synchronizes the device; a few "
     "microseconds. An error of gpuwatch's after the step is recorded stops the observing "
     "(an event says so), never training."},
    {"_loop_optimizer_step", (PyCFunction)(void (*)(void))run_loop_step,
     METH_FASTCALL | METH_KEYWORDS,
     "optimizer_step(loss=None, samples=None, tokens=None, skipped=None, grad_norm=None, "
     "activation_bytes=None)\n--\n\n"
     "Mark an optimizer-step boundary: call it once per optimizer step, after "
     "``zero_grad()``.\n\n"
     "After ``optimizer.step()`` (or ``scaler.step``/``update``) and ``zero_grad()``. "
     "Pending commands apply here, so the next window runs with them. Give the arguments "
     "after ``loss`` by keyword.\n\n"
     "Args:\n"
     "    loss: the window's mean (undivided) loss, a 0-dim tensor on any device; by "
     "default the sum of the losses the window backpropagated through the run "
     "(:attr:`Session.scaler`, or ``fabric.backward``; see the module docstrings). A "
     "0-dim float32 or float64 host tensor is read here, from memory (no call); any other "
     "is read later, on the agent's thread (on the host, not copied: such a tensor the loop "
     "changes in place after this call is read as changed).\n"
     "    samples, tokens: the window's, if :meth:`loader` / :meth:`timed` did not see its "
     "batches.\n"
     "    skipped: fp16 only, when not using :attr:`Session.scaler`: what "
     ":meth:`gpuopt.MixedPrecision.step` returned.\n"
     "    grad_norm: what ``clip_grad_norm_`` returned (a tensor: read as ``loss`` is); by "
     "default the norm the run clipped with ``max_grad_norm``.\n"
     "    activation_bytes: a measurement of your own "
     "(:class:`gpuopt.memory.SavedActivations`); by default :attr:`Session.autocast` "
     "measures now and then.\n\n"
     "Raises:\n"
     "    TypeError: an argument it does not take, or one given twice.\n\n"
     ".. note:: In C (agent/step/_hot.c): no Python frame unless the window is not the "
     "scaler's (``_take_window``), the next window is planned (``_next_window``), the "
     "window's size is not ``accum_steps`` (``_window_off``) or the boundary has more to "
     "do. Never synchronizes the device and never blocks: a few microseconds."},
    {NULL},
};

static PyMemberDef run_members[] = {
    {"broken", T_BOOL, offsetof(Run, broken), 0, "the run stopped observing (:meth:`fail`)"},
    {"_pause_requested", T_BOOL, offsetof(Run, pause_requested), 0,
     "``pause=on`` applied and no ``pause=off`` since: the next boundary holds"},
    {"_recovering", T_BOOL, offsetof(Run, recovering), 0,
     "``recover=on``: states are kept for a loss-spike recovery"},
    {"_window_of_scaler", T_BOOL, offsetof(Run, window_of_scaler), 0,
     "the window's losses are the run's ``scaler``'s (a Session's): read without a call "
     "of ``_take_window`` when no backward went through it"},
    {"_next_window_due", T_BOOL, offsetof(Run, next_window_due), 0,
     "the loop's ``optimizer_step`` calls ``_next_window`` after each boundary"},
    {"step", T_OBJECT_EX, offsetof(Run, step), 0,
     "optimizer steps taken so far (a resumed run counts on from its checkpoint)"},
    {"agent", T_OBJECT_EX, offsetof(Run, agent), 0, "the run's agent"},
    {"position", T_OBJECT_EX, offsetof(Run, position), 0, "the data position"},
    {"meter", T_OBJECT_EX, offsetof(Run, meter), 0, "the window's meter"},
    {"_micro_batches_trained", T_OBJECT_EX, offsetof(Run, trained), 0,
     "micro-batches trained in all (every branch)"},
    {"_kept", T_OBJECT_EX, offsetof(Run, kept), 0,
     "the state kept for a rollback: ``(step, snapshot, bytes)``, or None"},
    {"_lr_back", T_OBJECT_EX, offsetof(Run, lr_back), 0,
     "a recovery's scaled learning rate: (the step it ends after, the value then), or None"},
    {"event_sources", T_OBJECT_EX, offsetof(Run, event_sources), 0,
     "callables returning events to publish after each step"},
    {"memory", T_OBJECT_EX, offsetof(Run, memory), 0, "the memory knobs"},
    {"optimizer_settings", T_OBJECT_EX, offsetof(Run, optimizer_settings), 0,
     "the optimizer's live settings, or None"},
    {"_windows_off", T_OBJECT_EX, offsetof(Run, windows_off), 0,
     "windows in a row whose size was not ``accum_steps``; None: not counted"},
    {"_accum_steps", T_OBJECT_EX, offsetof(Run, accum_steps), 0,
     "micro-batches per optimizer step, or None"},
    {"scaler", T_OBJECT_EX, offsetof(Run, scaler), 0,
     "a Session's GradScaler lookalike (whose window is read here), or None"},
    {"_activation_bytes", T_OBJECT_EX, offsetof(Run, activation_bytes), 0,
     "a Session's measurement of one micro-batch's saved activations, for the next record"},
    {NULL},
};

static PyTypeObject RunType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "agent.step._hot.RunPath",
    .tp_doc = PyDoc_STR(
        "A run's training-thread state and its boundary, in C: the base of "
        ":class:`agent.integrations.run.RunBase`, which sets its fields in ``__init__`` "
        "and provides what the rare paths call: ``_after_boundary()`` (pause, rollback, "
        "recovery, events, memory), and for a loop (:class:`agent.integrations.loop."
        "LoopRun`, whose ``optimizer_step`` is ``_loop_optimizer_step``) "
        "``_take_window()``, ``_window_off(counted)`` and ``_next_window()``."),
    .tp_basicsize = sizeof(Run),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_new = run_new,
    .tp_traverse = (traverseproc)run_traverse,
    .tp_clear = (inquiry)run_clear,
    .tp_dealloc = (destructor)run_dealloc,
    .tp_methods = run_methods,
    .tp_members = run_members,
};

static PyObject *
define(PyObject *module, PyObject *arg)
{
    if (!PyUnicode_Check(arg)) {
        PyErr_SetString(PyExc_TypeError, "define(docstring)");
        return NULL;
    }
    if (RecordType.tp_doc == NULL) {
        const char *doc = PyUnicode_AsUTF8(arg);
        if (doc == NULL)
            return NULL;
        char *kept = PyMem_RawMalloc(strlen(doc) + 1);  /* (lives as long as the type) */
        if (kept == NULL)
            return PyErr_NoMemory();
        strcpy(kept, doc);
        RecordType.tp_doc = kept;
        if (PyType_Ready(&RecordType) < 0)
            return NULL;
    }
    return Py_NewRef((PyObject *)&RecordType);
}

static PyMethodDef module_methods[] = {
    {"define", define, METH_O,
     "define(docstring)\n--\n\nThe StepRecord type, with ``docstring`` (made once)."},
    {"columns", (PyCFunction)(void (*)(void))columns, METH_FASTCALL,
     "columns(records, names)\n--\n\n"
     "The fields ``names`` (a tuple) of ``records`` (a list of StepRecords), one list a "
     "field, as a tuple: one pass over the records.\n\n"
     "Raises:\n"
     "    ValueError: a name is not a StepRecord's field.\n"
     "    TypeError: an item is not a StepRecord.\n"
     "    AttributeError: a field named was deleted from a record."},
    {"host_mark", (PyCFunction)(void (*)(void))host_mark, METH_FASTCALL,
     "host_mark(loss, skipped=None, grad_norm=None)\n--\n\n"
     "The marker of a step on the host: the loss itself (a tensor, a number, or None) "
     "when there is neither a flag nor a norm (the usual: the encoder takes a run of "
     "such markers as the losses' column); else the tuple ``(loss, skipped, grad_norm)``: "
     "the GradScaler's skipped flag and the gradient norm (0-dim tensors, a float for "
     "the norm, or None).\n\n"
     ".. note:: No torch call, nothing read (the I/O thread reads the values later), so "
     "a loss tensor changed in place after its step is read as changed (pass a copy, "
     "``loss.detach().clone()``, if the loop reuses its tensor). The agent's hot path "
     "reads a 0-dim float32 or float64 host loss and norm before it marks, so those are "
     "read at the boundary."},
    {NULL},
};

static struct PyModuleDef hot_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "agent.step._hot",
    .m_doc = "The agent's part of the optimizer step, in C (see agent/step/_hot.c).",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC
PyInit__hot(void)
{
    for (int i = 0; i < FIELDS; i++) {
        if ((names[i] = PyUnicode_InternFromString(field_names[i])) == NULL)
            return NULL;
        record_members[i] = (PyMemberDef){(char *)field_names[i], T_OBJECT_EX,
                                          offsetof(Record, values) + i * sizeof(PyObject *),
                                          0, NULL};
    }
    if ((zero = PyLong_FromLong(0)) == NULL
            || (str_mark = PyUnicode_InternFromString("mark")) == NULL
            || (str_mark_read = PyUnicode_InternFromString("mark_read")) == NULL
            || (str_encoder = PyUnicode_InternFromString("_encoder")) == NULL
            || (str_overflowing = PyUnicode_InternFromString("overflowing")) == NULL
            || (str_tell_step = PyUnicode_InternFromString("_tell_step")) == NULL
            || (str_apply_pending = PyUnicode_InternFromString("_apply_pending")) == NULL
            || (str_report_error = PyUnicode_InternFromString("report_error")) == NULL
            || (str_hot_path = PyUnicode_InternFromString("hot path")) == NULL
            || (one = PyLong_FromLong(1)) == NULL
#define INTERN(var, text) || (var = PyUnicode_InternFromString(text)) == NULL
            INTERN(str_window_done, "window_done") INTERN(str_take, "take")
            INTERN(str_take_step, "take_step") INTERN(str_take_window, "take_window")
            INTERN(str_own_window, "_take_window")
            INTERN(str_window_off, "_window_off") INTERN(str_next_window, "_next_window")
            INTERN(str_after_boundary, "_after_boundary")
                    INTERN(str_micro_batches, "micro_batches") INTERN(str_skipped, "skipped")
            INTERN(str_snapshot_steps_left, "snapshot_steps_left")
            INTERN(str_optimizer_step, "optimizer_step"))
#undef INTERN
        return NULL;
    for (int i = 0; i < STEP_ARGS; i++)
        if ((step_args[i] = PyUnicode_InternFromString(step_arg_names[i])) == NULL)
            return NULL;
    if ((hotpath = PyCapsule_Import(HOTPATH_API_NAME, 0)) == NULL)
        return NULL;
    if (PyType_Ready(&HotType) < 0 || PyType_Ready(&WindowType) < 0
            || PyType_Ready(&RunType) < 0 || PyType_Ready(&BatchType) < 0)
        return NULL;
    PyObject *module = PyModule_Create(&hot_module);
    if (module == NULL || PyModule_AddObjectRef(module, "HotPath", (PyObject *)&HotType) < 0
            || PyModule_AddObjectRef(module, "ShareWindow", (PyObject *)&WindowType) < 0
            || PyModule_AddObjectRef(module, "RunPath", (PyObject *)&RunType) < 0
            || PyModule_AddObjectRef(module, "StepsBatch", (PyObject *)&BatchType) < 0) {
        Py_XDECREF(module);
        return NULL;
    }
    return module;
}
