/* agent.step._hot: the agent's part of the training thread's optimizer step, in C.
 *
 * - StepRecord (agent.step.record.StepRecord): one is made at every optimizer step. As a
 *   slotted dataclass its __init__ was a Python frame of 13 stores, about 1 us of CPU
 *   between real steps (the caches are cold there); made here, by vectorcall, it is one
 *   allocation and the stores. Its fields, their order and defaults, and their meaning
 *   are StepRecord's docstring's.
 * - HotPath, the base of agent.step.core.Agent: its optimizer_step (a clock read, the
 *   step's marker, a deque append, the pending-command check), with no Python frame
 *   unless listeners or commands wait, the I/O thread is behind, or the marker is a
 *   device's.
 * - host_mark: agent.step.markers.CpuMarker's mark.
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

#include "gpuopt/_hotclock.h"

#define FIELDS 13
#define REQUIRED 3
/* the fields the hot path reads or sets, by index */
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
record_traverse(Record *self, visitproc visit, void *arg)
{
    for (int i = 0; i < FIELDS; i++)
        Py_VISIT(self->values[i]);
    return 0;
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
    PyObject_GC_UnTrack(self);
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
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = record_new,
    .tp_vectorcall = record_vectorcall,  /* (calling the type; its instances are not callable) */
    .tp_traverse = (traverseproc)record_traverse,
    .tp_clear = (inquiry)record_clear,
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
        read[i] = PyFloat_AsDouble(PyList_GET_ITEM(args[i < n ? 0 : 1], i % n));
        if (read[i] == -1.0 && PyErr_Occurred()) {
            PyMem_Free(read);
            return NULL;
        }
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
     "is not a number raises TypeError before any step is added."},
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

/* ------------------------------------------------------------------ HotPath */

static PyObject *str_mark, *str_mark_read, *str_append, *str_encoder, *str_overflowing,
    *str_tell_step, *str_apply_pending, *str_report_error, *str_hot_path;

typedef struct {
    PyObject_HEAD
    char broken;                /* _broken */
    char marks_on_host;         /* _marks_on_host: the marker is a CpuMarker */
    Py_ssize_t held_max;        /* _held_max */
    Py_ssize_t queue_size;      /* _queue_size */
    PyObject *last_boundary_t;  /* _last_boundary_t: None or a float */
    PyObject *records;          /* _records: the deque of StepRecords */
    PyObject *marker;           /* _marker */
    PyObject *knob_values;      /* _knob_values */
    PyObject *last_step;        /* _last_step */
    PyObject *listeners;        /* _listeners: a tuple */
    PyObject *pending;          /* _pending: the desk's list of pending commands */
} Hot;

#define HOT_OBJECTS(X) X(last_boundary_t) X(records) X(marker) X(knob_values) \
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

static int
hot_step(Hot *self, PyObject *arg)
{
    if (!Py_IS_TYPE(arg, &RecordType)) {
        PyErr_Format(PyExc_TypeError, "optimizer_step needs a StepRecord, got %.100s",
                     Py_TYPE(arg)->tp_name);
        return -1;
    }
    if (!self->last_boundary_t || !self->records || !self->marker || !self->knob_values
            || !self->last_step || !self->listeners || !self->pending) {
        PyErr_SetString(PyExc_AttributeError, "a field of the agent's hot path was deleted");
        return -1;
    }
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
    Py_SETREF(self->last_boundary_t, boundary_t);

    Py_ssize_t queued = PyObject_Length(self->records);
    if (queued < 0)
        return -1;
    PyObject *marker;
    if (queued < self->held_max) {
        marker = self->marks_on_host
            ? host_mark_of(values[LOSS], values[SKIPPED], values[GRAD_NORM])
            : PyObject_CallMethodObjArgs(self->marker, str_mark, values[LOSS], values[SKIPPED],
                                         values[GRAD_NORM], NULL);
    }
    else {  /* the I/O thread is behind: no more autograd graphs held */
        marker = PyObject_CallMethodObjArgs(self->marker, str_mark_read, values[LOSS],
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
    }
    if (marker == NULL)
        return -1;
    Py_XSETREF(values[MARKER], marker);
    Py_SETREF(values[LOSS], Py_NewRef(Py_None));  /* (the marker holds what is read) */
    Py_XSETREF(values[KNOBS], Py_NewRef(self->knob_values));
    if (call_method(self->records, str_append, arg) < 0)
        return -1;
    Py_SETREF(self->last_step, Py_NewRef(values[STEP]));
    int telling = PyObject_IsTrue(self->listeners);
    if (telling < 0 || (telling && call_method((PyObject *)self, str_tell_step, arg) < 0))
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
     "a clock read, a marker (an asynchronous CUDA event on GPU; on the host the loss "
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
    {"_records", T_OBJECT_EX, offsetof(Hot, records), 0, "the record queue (a deque)"},
    {"_marker", T_OBJECT_EX, offsetof(Hot, marker), 0, "the step marker kind"},
    {"_knob_values", T_OBJECT_EX, offsetof(Hot, knob_values), 0,
     "the knob values steps train with now"},
    {"_last_step", T_OBJECT_EX, offsetof(Hot, last_step), 0, "the last step recorded"},
    {"_listeners", T_OBJECT_EX, offsetof(Hot, listeners), 0,
     "the in-process record listeners (a tuple)"},
    {"_pending", T_OBJECT_EX, offsetof(Hot, pending), 0, "the desk's pending commands"},
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
     "``loss.detach().clone()``, if the loop reuses its tensor)."},
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
            || (str_append = PyUnicode_InternFromString("append")) == NULL
            || (str_encoder = PyUnicode_InternFromString("_encoder")) == NULL
            || (str_overflowing = PyUnicode_InternFromString("overflowing")) == NULL
            || (str_tell_step = PyUnicode_InternFromString("_tell_step")) == NULL
            || (str_apply_pending = PyUnicode_InternFromString("_apply_pending")) == NULL
            || (str_report_error = PyUnicode_InternFromString("report_error")) == NULL
            || (str_hot_path = PyUnicode_InternFromString("hot path")) == NULL)
        return NULL;
    if (PyType_Ready(&HotType) < 0 || PyType_Ready(&WindowType) < 0)
        return NULL;
    PyObject *module = PyModule_Create(&hot_module);
    if (module == NULL || PyModule_AddObjectRef(module, "HotPath", (PyObject *)&HotType) < 0
            || PyModule_AddObjectRef(module, "ShareWindow", (PyObject *)&WindowType) < 0) {
        Py_XDECREF(module);
        return NULL;
    }
    return module;
}
