/* gpuopt._hotpath: the per-fetch counting of a training loop, in C.
 *
 * What runs on the training thread for every batch a loop fetches: the data position's
 * counters (gpuopt.position.DataPosition), the accumulation window's meter (data wait,
 * micro-batches, samples, tokens) and the steady state of the position's iteration (a
 * timed next() of the epoch's iterator, counted). In Python each was a frame, and a frame
 * between real steps costs 0.4 to 1 us of CPU (the caches are cold there); here the
 * steady state of a fetch runs no Python code at all. Everything else (an epoch's start
 * and end, a restored position's replay, dropped batches) stays in Python, in the
 * generator that Fetches hands over to (gpuopt.position.DataPosition.iterate).
 *
 * Never reads tensor data and never synchronizes a device: a batch's samples are dim 0
 * of its first tensor's shape, read from the tensor's C++ object where its layout was
 * learned at import (see "Dim 0 without a call" below), else through ``shape``.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include "gpuopt/_hotshared.h"
#include "gpuopt/_hotpath_api.h"

static PyObject *str_item;  /* interned "item" */
static PyObject *tensor_type;      /* torch.Tensor */
static PyObject *mapping_abc;      /* collections.abc.Mapping */
static PyObject *str_shape, *str_get, *str_input_ids, *str_numel, *str_close,
    *str_empty;

/* ------------------------------------------------------------------ PositionCounts */

typedef struct {
    PyObject_HEAD
    Py_ssize_t fetched_in_epoch;
    Py_ssize_t fetched_total;
    Py_ssize_t trained_total;
    Py_ssize_t dropping;
    Py_ssize_t keeping;  /* _keeping: how many of the latest batches _recent keeps */
    Py_ssize_t keeping_most;  /* _keeping_most: the most it may keep */
    PyObject *recent;    /* _recent: deque of (key, batch) */
    PyObject *recent_append;  /* its bound append (no method lookup a fetch) */
    PyObject *restored;  /* _restored: None, or a restored position */
} Counts;

static PyTypeObject CountsType;

static PyObject *
counts_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    Counts *self = (Counts *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->recent = Py_NewRef(Py_None);
    self->restored = Py_NewRef(Py_None);
    return (PyObject *)self;
}

static int
counts_traverse(Counts *self, visitproc visit, void *arg)
{
    Py_VISIT(self->recent);
    Py_VISIT(self->recent_append);
    Py_VISIT(self->restored);
    return 0;
}

static int
counts_clear(Counts *self)
{
    Py_CLEAR(self->recent);
    Py_CLEAR(self->recent_append);
    Py_CLEAR(self->restored);
    return 0;
}

static void
counts_dealloc(Counts *self)
{
    PyObject_GC_UnTrack(self);
    counts_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);  /* (a subclass's type: its own dealloc's) */
}

/* one training batch fetched: the two counters and the latest batches kept */
static int
counts_count(Counts *self, PyObject *batch, PyObject *key)
{
    if (self->recent_append == NULL) {
        PyErr_SetString(PyExc_AttributeError, "the data position's _recent was deleted");
        return -1;
    }
    self->fetched_in_epoch += 1;
    self->fetched_total += 1;
    PyObject *item = PyTuple_Pack(2, key, batch);
    if (item == NULL)
        return -1;
    PyObject *done = PyObject_CallOneArg(self->recent_append, item);
    Py_DECREF(item);
    if (done == NULL)
        return -1;
    Py_DECREF(done);
    return 0;
}

static PyObject *
counts_count_method(Counts *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "_count(batch, key='') takes 1 or 2 arguments");
        return NULL;
    }
    if (counts_count(self, args[0], nargs == 2 ? args[1] : str_empty) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static int
counts_done(PyObject *counts, Py_ssize_t micro_batches)
{
    Counts *self = (Counts *)counts;
    self->trained_total += micro_batches;
    Py_ssize_t ahead = self->fetched_total - self->trained_total;
    if (ahead > self->keeping && self->keeping < self->keeping_most) {  /* (rare) */
        PyObject *done = PyObject_CallMethod((PyObject *)self, "_keep", "n", ahead);
        if (done == NULL)
            return -1;
        Py_DECREF(done);
    }
    return 0;
}

static PyObject *
counts_window_done(Counts *self, PyObject *arg)
{
    Py_ssize_t micro_batches = PyNumber_AsSsize_t(arg, PyExc_OverflowError);
    if (micro_batches == -1 && PyErr_Occurred())
        return NULL;
    if (counts_done((PyObject *)self, micro_batches) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef counts_methods[] = {
    {"window_done", (PyCFunction)counts_window_done, METH_O,
     "window_done(micro_batches)\n--\n\nAn accumulation window of ``micro_batches`` "
     "micro-batches was trained.\n\nCall at the boundary, before a checkpoint of it may "
     "be taken. From now on the position keeps as many batches as were fetched ahead of "
     "this boundary (if more than before; up to ``_keeping_most``), for "
     "the checkpoints of later ones: ``_keep(ahead)``.\n\n.. note:: An addition and a "
     "comparison: no Python frame, unless more are fetched ahead than kept.\n\n"
     "Raises:\n    TypeError: ``micro_batches`` is not an integer (``__index__``)."},
    {"_count", (PyCFunction)(void (*)(void))counts_count_method, METH_FASTCALL,
     "_count(batch, key='')\n--\n\nOne training batch fetched (``key``: which source, "
     "for :meth:`timed_fetch`'s arguments): counted, and kept among the latest."},
    {NULL},
};

static PyMemberDef counts_members[] = {
    {"fetched_in_epoch", T_PYSSIZET, offsetof(Counts, fetched_in_epoch), 0,
     "training batches fetched in the epoch in progress"},
    {"fetched_total", T_PYSSIZET, offsetof(Counts, fetched_total), 0,
     "training batches fetched since the run began"},
    {"trained_total", T_PYSSIZET, offsetof(Counts, trained_total), 0,
     "training batches trained on by finished windows (or dropped)"},
    {"dropping", T_PYSSIZET, offsetof(Counts, dropping), 0,
     "training batches the iteration is still to draw and drop"},
    {"_keeping", T_PYSSIZET, offsetof(Counts, keeping), 0,
     "how many of the latest training batches fetched are kept"},
    {"_keeping_most", T_PYSSIZET, offsetof(Counts, keeping_most), 0,
     "the most of them kept (gpuopt.position.MAX_AHEAD)"},
    {"_restored", T_OBJECT_EX, offsetof(Counts, restored), 0,
     "a restored position the iteration has not gone back to yet, or None"},
    {NULL},
};

static PyObject *
counts_get_recent(Counts *self, void *closure)
{
    return queue_get(self->recent, "_recent");
}

static int
counts_set_recent(Counts *self, PyObject *value, void *closure)
{
    return queue_set(&self->recent, &self->recent_append, value);
}

static PyGetSetDef counts_getset[] = {
    {"_recent", (getter)counts_get_recent, (setter)counts_set_recent,
     "the latest training batches fetched, (key, batch): a deque, or anything with an "
     "``append``", NULL},
    {NULL},
};

static PyTypeObject CountsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "gpuopt._hotpath.PositionCounts",
    .tp_doc = PyDoc_STR(
        "The counters of a data position that every fetch moves (the base of "
        ":class:`gpuopt.position.DataPosition`): fetched in the epoch, fetched and trained "
        "in all, batches to drop, the latest batches kept, a restored position waiting.\n\n"
        ".. note:: :meth:`_count` costs two additions and a deque append: no Python frame."),
    .tp_basicsize = sizeof(Counts),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_new = counts_new,
    .tp_traverse = (traverseproc)counts_traverse,
    .tp_clear = (inquiry)counts_clear,
    .tp_dealloc = (destructor)counts_dealloc,
    .tp_methods = counts_methods,
    .tp_members = counts_members,
    .tp_getset = counts_getset,
};

/* ------------------------------------------------------------------ WindowMeter */

typedef struct {
    PyObject_HEAD
    PyObject *count_samples;
    PyObject *tokens_per_sample;  /* None or an int >= 1 */
    double data_wait_s;
    Py_ssize_t fetched;
    Py_ssize_t samples;
    PyObject *tokens;             /* None or an int */
    int dim0;                     /* count_samples is gpuopt.data.batch_size */
} Meter;

static PyTypeObject MeterType;

static int
meter_init(Meter *self, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"count_samples", "tokens_per_sample", NULL};
    PyObject *count_samples, *tokens_per_sample = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|O:WindowMeter", names, &count_samples,
                                     &tokens_per_sample))
        return -1;
    if (!PyCallable_Check(count_samples)) {
        PyErr_Format(PyExc_TypeError, "count_samples must be callable, got %R", count_samples);
        return -1;
    }
    if (tokens_per_sample != Py_None) {
        int below = 1;
        if (PyLong_Check(tokens_per_sample) && !PyBool_Check(tokens_per_sample)) {
            PyObject *one = PyLong_FromLong(1);
            below = PyObject_RichCompareBool(tokens_per_sample, one, Py_LT);
            Py_DECREF(one);
            if (below < 0)
                return -1;
        }
        if (below) {
            PyErr_Format(PyExc_ValueError,
                         "tokens_per_sample must be an integer >= 1, got %R", tokens_per_sample);
            return -1;
        }
    }
    PyObject *data = PyImport_ImportModule("gpuopt.data");
    if (data == NULL)
        return -1;
    PyObject *batch_size = PyObject_GetAttrString(data, "batch_size");
    Py_DECREF(data);
    if (batch_size == NULL)
        return -1;
    self->dim0 = count_samples == batch_size;
    Py_DECREF(batch_size);
    Py_XSETREF(self->count_samples, Py_NewRef(count_samples));
    Py_XSETREF(self->tokens_per_sample, Py_NewRef(tokens_per_sample));
    Py_XSETREF(self->tokens, Py_NewRef(Py_None));
    self->data_wait_s = 0.0;
    self->fetched = 0;
    self->samples = 0;
    return 0;
}

static int
meter_traverse(Meter *self, visitproc visit, void *arg)
{
    Py_VISIT(self->count_samples);
    Py_VISIT(self->tokens_per_sample);
    Py_VISIT(self->tokens);
    return 0;
}

static int
meter_clear(Meter *self)
{
    Py_CLEAR(self->count_samples);
    Py_CLEAR(self->tokens_per_sample);
    Py_CLEAR(self->tokens);
    return 0;
}

static void
meter_dealloc(Meter *self)
{
    PyObject_GC_UnTrack(self);
    meter_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);  /* (a subclass's type: its own dealloc's) */
}

/* ------------------------------------------------------------------ Dim 0 without a call
 *
 * Reading ``tensor.shape`` costs 0.12 us warm but about 1 us between real steps (the
 * caches cold: torch's getter, its __torch_function__ check, a torch.Size built), the
 * largest single cost of a fetch. The size is a field of the tensor's C++ object
 * (c10::TensorImpl::sizes_and_strides_: the dim count, then up to 5 sizes inline), so at
 * import this learns, from probe tensors whose sizes it made, where a torch.Tensor holds
 * its TensorImpl (the word equal to ``_cdata``, inside the Python object) and where the
 * TensorImpl holds its sizes (the first word run equal to a probe's dim count and sizes,
 * the same for all three probes), and the plain TensorImpl's vtable. A fetch then reads
 * dim 0 there only for a tensor of exactly torch.Tensor's type whose TensorImpl has that
 * vtable (a dense tensor: not nested, sparse, quantized, MKLDNN or a wrapper, whose
 * sizes live elsewhere) and 1 to 5 dims (inline); any other tensor, or a torch whose
 * layout the probes do not confirm, goes through ``shape`` as before.
 *
 * A plain TensorImpl may still hold symbolic sizes (SymInts of a ShapeEnv, e.g. after
 * ``as_strided_((s0, 3), ...)``, or a meta tensor made with them): those live in its
 * ``extra_meta_`` and ``sizes_and_strides_`` keeps stale values. So the read also asks
 * ``extra_meta_`` to be NULL (else ``shape``): the word declared right after
 * ``autograd_meta_``, which the probes find as the one word ``requires_grad_()`` sets. */

static Py_ssize_t impl_offset = -1;   /* the TensorImpl pointer, in a torch.Tensor object */
static Py_ssize_t sizes_offset = -1;  /* sizes_and_strides_ (its dim count), in a TensorImpl */
static Py_ssize_t extra_offset = -1;  /* extra_meta_ (NULL unless symbolic sizes...) */
static void *dense_vtable;            /* a plain TensorImpl's */

#define INLINE_DIMS 5
#define IMPL_SCAN_BYTES 512

/* Dim 0 of ``tensor`` (exactly a torch.Tensor) read from its TensorImpl: 1 for 0 dims,
 * -1 where it cannot be read directly (no layout learned, another TensorImpl kind,
 * more than 5 dims). Reads memory only; never calls torch. */
static Py_ssize_t
direct_dim0(PyObject *tensor)
{
    if (sizes_offset < 0)
        return -1;
    char *impl = *(char **)((char *)tensor + impl_offset);
    if (impl == NULL || *(void **)impl != dense_vtable
            || *(void **)(impl + extra_offset) != NULL)
        return -1;
    int64_t dims = *(int64_t *)(impl + sizes_offset);
    if (dims == 0)
        return 1;
    if (dims < 0 || dims > INLINE_DIMS)
        return -1;
    return (Py_ssize_t)*(int64_t *)(impl + sizes_offset + 8);
}

/* A probe: torch.empty(sizes, device="cpu") (explicit: a default device set before this
 * import must not start CUDA here), its TensorImpl's address in *impl. NULL with an
 * error. */
static PyObject *
layout_probe(PyObject *empty, PyObject *sizes, char **impl)
{
    PyObject *args = PyTuple_Pack(1, sizes);
    PyObject *kwargs = args == NULL ? NULL : Py_BuildValue("{ss}", "device", "cpu");
    PyObject *tensor = kwargs == NULL ? NULL : PyObject_Call(empty, args, kwargs);
    Py_XDECREF(args);
    Py_XDECREF(kwargs);
    if (tensor == NULL)
        return NULL;
    PyObject *cdata = PyObject_GetAttrString(tensor, "_cdata");
    if (cdata == NULL) {
        Py_DECREF(tensor);
        return NULL;
    }
    *impl = (char *)PyLong_AsVoidPtr(cdata);
    Py_DECREF(cdata);
    if (*impl == NULL || Py_TYPE(tensor) != (PyTypeObject *)tensor_type) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_RuntimeError, "a probe is not a plain tensor");
        Py_DECREF(tensor);
        return NULL;
    }
    return tensor;
}

/* Whether the words at ``impl + offset`` are ``sizes``' count and items. */
static int
sizes_at(char *impl, Py_ssize_t offset, PyObject *sizes)
{
    Py_ssize_t dims = PyTuple_GET_SIZE(sizes);
    if (*(int64_t *)(impl + offset) != dims)
        return 0;
    for (Py_ssize_t i = 0; i < dims; i++)
        if (*(int64_t *)(impl + offset + 8 * (i + 1))
                != PyLong_AsLongLong(PyTuple_GET_ITEM(sizes, i)))
            return 0;
    return 1;
}

/* Learn the layout from three probes (see above); leaves it unlearned (-1) on any
 * mismatch or error, the error cleared: ``shape`` is then read, as before. */
static void
learn_layout(PyObject *torch)
{
    PyObject *empty = PyObject_GetAttrString(torch, "empty");
    PyObject *shapes[3] = {Py_BuildValue("(ii)", 7919, 3), Py_BuildValue("(i)", 104723),
                           Py_BuildValue("(iiiii)", 13, 1, 2, 3, 5)};
    PyObject *probes[3] = {NULL, NULL, NULL};
    char *impls[3];
    Py_ssize_t found_impl = -1, found_sizes = -1;
    int ok = empty != NULL && shapes[0] && shapes[1] && shapes[2];
    for (int i = 0; ok && i < 3; i++)
        ok = (probes[i] = layout_probe(empty, shapes[i], &impls[i])) != NULL;
    if (ok) {
        Py_ssize_t end = Py_TYPE(probes[0])->tp_basicsize;  /* (inside the object) */
        for (Py_ssize_t at = sizeof(PyObject); at + 8 <= end && found_impl < 0; at += 8)
            if (*(char **)((char *)probes[0] + at) == impls[0])
                found_impl = at;
        for (Py_ssize_t at = 8; at < IMPL_SCAN_BYTES && found_sizes < 0; at += 8)
            if (sizes_at(impls[0], at, shapes[0]))
                found_sizes = at;
        ok = found_impl >= 0 && found_sizes >= 0;
        for (int i = 1; ok && i < 3; i++)
            ok = *(char **)((char *)probes[i] + found_impl) == impls[i]
                 && *(void **)impls[i] == *(void **)impls[0]
                 && sizes_at(impls[i], found_sizes, shapes[i]);
    }
    Py_ssize_t found_extra = -1;
    if (ok) {  /* autograd_meta_: the one word before the sizes requires_grad_() sets */
        int64_t before[IMPL_SCAN_BYTES / 8];
        for (Py_ssize_t at = 8; at < found_sizes; at += 8)
            before[at / 8] = *(int64_t *)(impls[1] + at);
        PyObject *done = PyObject_CallMethod(probes[1], "requires_grad_", NULL);
        ok = done != NULL && *(char **)((char *)probes[1] + found_impl) == impls[1];
        Py_XDECREF(done);
        for (Py_ssize_t at = 8; ok && at < found_sizes; at += 8)
            if (*(int64_t *)(impls[1] + at) != before[at / 8]) {
                if (before[at / 8] != 0 || found_extra >= 0)
                    ok = 0;  /* (more than one word changed: unsure) */
                else
                    found_extra = at + 8;
            }
        ok = ok && found_extra >= 0 && found_extra < found_sizes;
        for (int i = 0; ok && i < 3; i++)
            ok = *(void **)(impls[i] + found_extra) == NULL;
    }
    if (ok) {
        impl_offset = found_impl;
        extra_offset = found_extra;
        dense_vtable = *(void **)impls[0];
        sizes_offset = found_sizes;
    }
    for (int i = 0; i < 3; i++) {
        Py_XDECREF(probes[i]);
        Py_XDECREF(shapes[i]);
    }
    Py_XDECREF(empty);
    PyErr_Clear();
}

/* ------------------------------------------------------------------ A host scalar without a call
 *
 * The loss of a step on the host is a 0-dim tensor, read once (``item()``): about 0.17 us
 * warm on the I/O thread (torch's argument parser, its dispatcher, a Scalar), 1 to 4 us
 * on the training thread between real steps, where the agent reads it while the I/O
 * thread is behind (agent.step.markers.CpuMarker.mark_read). The value is a float of
 * host memory: at import this learns, from probe tensors, where a TensorImpl holds its
 * storage (the word equal to the storage's ``_cdata``), its storage offset (the word a
 * view's offset sets), its dtype (the TypeMeta index: 6 float32, 7 float64, 4 int64 on
 * three probes) and its dispatch key set (the one word every plain probe has alike,
 * whatever its dtype, view, grad or graph, that a negative view changes by one key), and
 * where a StorageImpl holds its data pointer and its size in bytes. A read then takes
 * the value from memory only for a 0-dim float32 or float64 tensor of exactly
 * torch.Tensor's type, the dense vtable, no extra_meta_, that key set (a dense CPU
 * tensor: not negative, not a zero tensor, not inference-mode's; any other device's
 * tensor has other keys) and an offset inside its storage's bytes; any other tensor, or
 * a torch whose layout the probes do not confirm, is read by ``item()`` as before. */

static Py_ssize_t storage_at = -1;  /* storage_ (a StorageImpl pointer), in a TensorImpl */
static Py_ssize_t offset_at = -1;   /* storage_offset_ (int64), in a TensorImpl */
static Py_ssize_t dtype_at = -1;    /* data_type_ (uint16 TypeMeta index), in a TensorImpl */
static Py_ssize_t keys_at = -1;     /* key_set_ (uint64), in a TensorImpl */
static Py_ssize_t data_at = -1;     /* data_ptr_'s data pointer, in a StorageImpl */
static Py_ssize_t nbytes_at = -1;   /* size_bytes_ (int64 unless symbolic), in a StorageImpl */
static uint64_t dense_keys;          /* the key set of a dense CPU tensor */
#define FLOAT32_INDEX 6
#define FLOAT64_INDEX 7
#define INT64_INDEX 4
#define STORAGE_SCAN_BYTES 96

/* Whether ``tensor`` is read here: 1 with its value in *value; 0 where ``item()`` reads
 * it (see above). Reads memory only; never calls torch, never raises. */
static int
direct_scalar(PyObject *tensor, double *value)
{
    if (keys_at < 0 || sizes_offset < 0 || (PyObject *)Py_TYPE(tensor) != tensor_type)
        return 0;
    char *impl = *(char **)((char *)tensor + impl_offset);
    if (impl == NULL || *(void **)impl != dense_vtable
            || *(void **)(impl + extra_offset) != NULL || *(int64_t *)(impl + sizes_offset) != 0)
        return 0;
    int dense = *(uint64_t *)(impl + keys_at) == dense_keys;
    uint16_t dtype = *(uint16_t *)(impl + dtype_at);
    int64_t size = dtype == FLOAT32_INDEX ? 4 : dtype == FLOAT64_INDEX ? 8 : 0;
    char *storage = *(char **)(impl + storage_at);
    if (!dense || size == 0 || storage == NULL)
        return 0;
    char *data = *(char **)(storage + data_at);
    int64_t offset = *(int64_t *)(impl + offset_at), nbytes = *(int64_t *)(storage + nbytes_at);
    if (data == NULL || offset < 0 || nbytes < 0 || offset >= nbytes / size)
        return 0;
    *value = size == 4 ? (double)((float *)data)[offset] : ((double *)data)[offset];
    return 1;
}

/* The address ``method()`` of ``object`` gives (an int), or NULL with an error. */
static char *
address_of(PyObject *object, const char *method)
{
    PyObject *result = PyObject_CallMethod(object, method, NULL);
    char *address = result == NULL ? NULL : (char *)PyLong_AsVoidPtr(result);
    Py_XDECREF(result);
    return address;
}

/* A probe's TensorImpl and its storage's StorageImpl, data pointer and size in bytes. */
typedef struct {
    PyObject *tensor;
    char *impl, *storage, *data;
    int64_t nbytes;
} ScalarProbe;

static int
scalar_probe(ScalarProbe *probe, PyObject *tensor)
{
    probe->tensor = tensor;
    if (tensor == NULL || (PyObject *)Py_TYPE(tensor) != tensor_type)
        return 0;
    PyObject *cdata = PyObject_GetAttrString(tensor, "_cdata");
    probe->impl = cdata == NULL ? NULL : (char *)PyLong_AsVoidPtr(cdata);
    Py_XDECREF(cdata);
    PyObject *storage = probe->impl == NULL ? NULL
                        : PyObject_CallMethod(tensor, "untyped_storage", NULL);
    if (storage == NULL)
        return 0;
    cdata = PyObject_GetAttrString(storage, "_cdata");
    probe->storage = cdata == NULL ? NULL : (char *)PyLong_AsVoidPtr(cdata);
    Py_XDECREF(cdata);
    probe->data = address_of(storage, "data_ptr");
    PyObject *nbytes = PyObject_CallMethod(storage, "nbytes", NULL);
    probe->nbytes = nbytes == NULL ? -1 : PyLong_AsLongLong(nbytes);
    Py_XDECREF(nbytes);
    Py_DECREF(storage);
    return probe->impl != NULL && probe->storage != NULL && probe->data != NULL
           && probe->nbytes > 0 && !PyErr_Occurred();
}

/* The first offset (a multiple of ``step`` below ``end``) where every probe's word of
 * ``width`` bytes at ``base(probe) + offset`` is its ``want``; -1 where none is. */
static Py_ssize_t
offset_where(ScalarProbe *probes, const int64_t *want, int count, int use_storage,
             Py_ssize_t step, int width, Py_ssize_t end)
{
    for (Py_ssize_t at = 8; at + width <= end; at += step) {
        int all = 1;
        for (int i = 0; all && i < count; i++) {
            char *base = use_storage ? probes[i].storage : probes[i].impl;
            int64_t word = width == 2 ? *(uint16_t *)(base + at) : *(int64_t *)(base + at);
            all = word == want[i];
        }
        if (all)
            return at;
    }
    return -1;
}

/* Learn the layout above (after learn_layout) from probes; leaves it unlearned on any
 * mismatch or error, the error cleared: ``item()`` is then called, as before. */
static void
learn_scalar_layout(PyObject *torch)
{
    enum { F32, F64, I64, VIEW3, VIEW5, GRAD, LOSS, NEG, PROBES };
    ScalarProbe probes[PROBES] = {{NULL}};
    PyObject *base = NULL;
    int ok = sizes_offset >= 0;
    if (ok) {
        PyObject *made[PROBES] = {NULL};
        /* (on the CPU: a default device set before this import must not be used here) */
        PyObject *arange = PyObject_GetAttrString(torch, "arange"),
                 *float32 = PyObject_GetAttrString(torch, "float32"),
                 *kwargs = float32 ? Py_BuildValue("{sOss}", "dtype", float32, "device", "cpu")
                                   : NULL,
                 *eight = Py_BuildValue("(i)", 8), *single = Py_BuildValue("(i)", 1);
        base = arange && kwargs && eight ? PyObject_Call(arange, eight, kwargs) : NULL;
        PyObject *one = arange && kwargs && single ? PyObject_Call(arange, single, kwargs)
                                                   : NULL;
        made[F32] = one ? PyObject_CallMethod(one, "sum", NULL) : NULL;  /* (0-dim: 0.0) */
        Py_XDECREF(one);
        Py_XDECREF(arange);
        Py_XDECREF(float32);
        Py_XDECREF(kwargs);
        Py_XDECREF(eight);
        Py_XDECREF(single);
        made[F64] = PyObject_CallMethod(made[F32] ? made[F32] : Py_None, "double", NULL);
        made[I64] = PyObject_CallMethod(made[F32] ? made[F32] : Py_None, "long", NULL);
        made[VIEW3] = base ? PyObject_CallMethod(base, "select", "ii", 0, 3) : NULL;
        made[VIEW5] = base ? PyObject_CallMethod(base, "select", "ii", 0, 5) : NULL;
        made[GRAD] = made[F32] ? PyObject_CallMethod(made[F32], "clone", NULL) : NULL;
        PyObject *set = made[GRAD] ? PyObject_CallMethod(made[GRAD], "requires_grad_", NULL)
                                   : NULL;
        Py_XDECREF(set);
        made[LOSS] = made[GRAD] ? PyNumber_Multiply(made[GRAD], made[GRAD]) : NULL;
        PyObject *neg_view = PyObject_GetAttrString(torch, "_neg_view");
        made[NEG] = neg_view && made[F32] ? PyObject_CallOneArg(neg_view, made[F32]) : NULL;
        Py_XDECREF(neg_view);
        for (int i = 0; i < PROBES; i++)
            ok &= scalar_probe(&probes[i], made[i]);  /* (each holds its tensor) */
    }
    if (ok) {
        int64_t storages[PROBES], offsets[] = {3, 5}, data[PROBES],
                nbytes[PROBES], types[] = {FLOAT32_INDEX, FLOAT64_INDEX, INT64_INDEX};
        for (int i = 0; i < PROBES; i++) {
            storages[i] = (int64_t)(intptr_t)probes[i].storage;
            data[i] = (int64_t)(intptr_t)probes[i].data;
            nbytes[i] = probes[i].nbytes;
        }
        storage_at = offset_where(probes, storages, PROBES, 0, 8, 8, IMPL_SCAN_BYTES);
        offset_at = offset_where(probes + VIEW3, offsets, 2, 0, 8, 8, IMPL_SCAN_BYTES);
        ok = storage_at >= 0 && offset_at >= 0
             && *(int64_t *)(probes[F32].impl + offset_at) == 0
             && *(int64_t *)(probes[F64].impl + offset_at) == 0;
        dtype_at = offset_where(probes, types, 3, 0, 2, 2, IMPL_SCAN_BYTES);
        data_at = offset_where(probes, data, PROBES, 1, 8, 8, STORAGE_SCAN_BYTES);
        nbytes_at = offset_where(probes, nbytes, PROBES, 1, 8, 8, STORAGE_SCAN_BYTES);
        ok = ok && dtype_at >= 0 && data_at >= 0 && nbytes_at >= 0 && data_at != nbytes_at;
    }
    Py_ssize_t found_keys = -1;
    for (Py_ssize_t at = 8; ok && at + 8 <= IMPL_SCAN_BYTES; at += 8) {
        uint64_t plain = *(uint64_t *)(probes[F32].impl + at),
                 negative = *(uint64_t *)(probes[NEG].impl + at), bit = plain ^ negative;
        int same = 1;  /* (a key set: every plain probe's, whatever its dtype or view) */
        for (int i = F64; same && i < NEG; i++)
            same = *(uint64_t *)(probes[i].impl + at) == plain;
        if (same && bit != 0 && (bit & (bit - 1)) == 0 && (negative & bit)) {
            ok = found_keys < 0;  /* (one key more on the negative view; two such: unsure) */
            found_keys = at;
        }
    }
    ok = ok && found_keys >= 0;
    if (ok)
        dense_keys = *(uint64_t *)(probes[F32].impl + found_keys);
    keys_at = ok ? found_keys : -1;
    if (ok) {  /* (the read itself, checked against what the probes hold) */
        double value = -1.0;
        ok = direct_scalar(probes[F32].tensor, &value) && value == 0.0
             && direct_scalar(probes[VIEW5].tensor, &value) && value == 5.0
             && !direct_scalar(probes[I64].tensor, &value)
             && !direct_scalar(probes[NEG].tensor, &value)
             && !direct_scalar(base, &value);
        if (!ok)
            keys_at = -1;
    }
    for (int i = 0; i < PROBES; i++)
        Py_XDECREF(probes[i].tensor);
    Py_XDECREF(base);
    PyErr_Clear();
}

/* host_items(tensors): see module_methods. */
static PyObject *
host_items(PyObject *module, PyObject *tensors)
{
    PyObject *fast = PySequence_Fast(tensors, "host_items(tensors): a sequence");
    if (fast == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject *values = PyList_New(n);
    for (Py_ssize_t i = 0; values != NULL && i < n; i++) {
        if (PySequence_Fast_GET_SIZE(fast) != n) {  /* (an item's Python changed it) */
            PyErr_SetString(PyExc_RuntimeError, "host_items: the list changed size");
            Py_CLEAR(values);
            break;
        }
        PyObject *tensor = Py_NewRef(PySequence_Fast_GET_ITEM(fast, i));
        double read;
        PyObject *value = direct_scalar(tensor, &read) ? PyFloat_FromDouble(read)
                          : PyObject_CallMethodNoArgs(tensor, str_item);
        Py_DECREF(tensor);
        if (value == NULL)
            Py_CLEAR(values);
        else
            PyList_SET_ITEM(values, i, value);
    }
    Py_DECREF(fast);
    return values;
}

static PyObject *
host_scalar_method(PyObject *module, PyObject *tensor)
{
    double value;
    if (!direct_scalar(tensor, &value))
        Py_RETURN_NONE;
    return PyFloat_FromDouble(value);
}

static PyObject *
direct_dim0_method(PyObject *module, PyObject *tensor)
{
    if (Py_TYPE(tensor) != (PyTypeObject *)tensor_type)
        Py_RETURN_NONE;
    Py_ssize_t size = direct_dim0(tensor);
    if (size < 0)
        Py_RETURN_NONE;
    return PyLong_FromSsize_t(size);
}

static PyObject *
tensor_layout(PyObject *module, PyObject *unused)
{
    if (sizes_offset < 0)
        Py_RETURN_NONE;
    return Py_BuildValue("(nnnnnnnnn)", impl_offset, sizes_offset, extra_offset, storage_at,
                         offset_at, dtype_at, keys_at, data_at, nbytes_at);
}

/* Samples in ``batch``: dim 0 of a tuple's or list's first item when it is a plain
 * tensor of dim >= 1 with a nonzero size (the common batch), read here; else what
 * count_samples says. -1 with an error set when it fails. */
static Py_ssize_t
meter_samples(Meter *self, PyObject *batch)
{
    if (self->dim0 && (PyTuple_CheckExact(batch) || PyList_CheckExact(batch))
            && PySequence_Fast_GET_SIZE(batch) > 0) {
        PyObject *first = PySequence_Fast_GET_ITEM(batch, 0);
        if ((PyObject *)Py_TYPE(first) == tensor_type) {
            Py_ssize_t direct = direct_dim0(first);
            if (direct > 0)
                return direct;
            PyObject *shape = PyObject_GetAttr(first, str_shape);
            if (shape == NULL)
                return -1;
            Py_ssize_t size = 0;
            if (PyTuple_Check(shape))
                size = PyTuple_GET_SIZE(shape) == 0  /* (a SymInt: __index__, as the call) */
                           ? 1 : PyNumber_AsSsize_t(PyTuple_GET_ITEM(shape, 0),
                                                    PyExc_OverflowError);
            Py_DECREF(shape);
            if (size != 0)  /* (-1 with an error: passed on) */
                return size;
        }
    }
    PyObject *counted = PyObject_CallOneArg(self->count_samples, batch);
    if (counted == NULL)
        return -1;
    Py_ssize_t size = PyNumber_AsSsize_t(counted, PyExc_OverflowError);  /* (__index__) */
    Py_DECREF(counted);
    return size;
}

/* Tokens in ``batch`` (a new reference), or None (borrowed Py_None, not increfed:
 * returned as NULL with no error) when it has none; NULL with an error when it fails. */
static PyObject *
meter_tokens(Meter *self, PyObject *batch, Py_ssize_t samples)
{
    if (self->tokens_per_sample != Py_None) {
        PyObject *count = PyLong_FromSsize_t(samples);
        if (count == NULL)
            return NULL;
        PyObject *tokens = PyNumber_Multiply(count, self->tokens_per_sample);
        Py_DECREF(count);
        return tokens;
    }
    if (PyTuple_CheckExact(batch) || PyList_CheckExact(batch))
        return NULL;  /* (the common batch, a tuple or list, has no input_ids) */
    int mapping = PyObject_IsInstance(batch, mapping_abc);
    if (mapping <= 0)
        return NULL;
    PyObject *ids = PyObject_CallMethodOneArg(batch, str_get, str_input_ids);
    if (ids == NULL)
        return NULL;
    PyObject *numel = PyObject_GetAttr(ids, str_numel);
    Py_DECREF(ids);
    if (numel == NULL) {
        if (PyErr_ExceptionMatches(PyExc_AttributeError))
            PyErr_Clear();
        return NULL;
    }
    PyObject *value = PyObject_CallNoArgs(numel);
    Py_DECREF(numel);
    if (value == NULL)
        return NULL;
    PyObject *tokens = PyNumber_Long(value);
    Py_DECREF(value);
    return tokens;
}

static int
meter_add(Meter *self, PyObject *batch, double wait_s)
{
    if (self->tokens == NULL) {
        PyErr_SetString(PyExc_AttributeError, "the window meter's tokens was deleted");
        return -1;
    }
    Py_ssize_t samples = meter_samples(self, batch);
    if (samples == -1 && PyErr_Occurred())
        return -1;
    self->data_wait_s += wait_s;
    self->fetched += 1;
    self->samples += samples;
    PyObject *tokens = meter_tokens(self, batch, samples);
    if (tokens == NULL)
        return PyErr_Occurred() ? -1 : 0;
    if (self->tokens != Py_None) {
        PyObject *sum = PyNumber_Add(self->tokens, tokens);
        Py_DECREF(tokens);
        if (sum == NULL)
            return -1;
        tokens = sum;
    }
    Py_SETREF(self->tokens, tokens);
    return 0;
}

static PyObject *
meter_add_method(Meter *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "add(batch, wait_s) takes 2 arguments");
        return NULL;
    }
    double wait_s = PyFloat_AsDouble(args[1]);
    if (wait_s == -1.0 && PyErr_Occurred())
        return NULL;
    if (meter_add(self, args[0], wait_s) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *
meter_timed_next(Meter *self, PyObject *iterator)
{
    if (!PyIter_Check(iterator)) {
        PyErr_Format(PyExc_TypeError, "timed_next needs an iterator, got %.100s",
                     Py_TYPE(iterator)->tp_name);
        return NULL;
    }
    double start = now_s();
    PyObject *batch = Py_TYPE(iterator)->tp_iternext(iterator);
    double wait_s = now_s() - start;
    if (batch == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetNone(PyExc_StopIteration);
        return NULL;
    }
    if (meter_add(self, batch, wait_s) < 0) {
        Py_DECREF(batch);
        return NULL;
    }
    return batch;
}

static int
meter_take_values(PyObject *meter, double *data_wait_s, Py_ssize_t *fetched,
                  Py_ssize_t *samples, PyObject **tokens)
{
    Meter *self = (Meter *)meter;
    if (self->tokens == NULL) {
        PyErr_SetString(PyExc_AttributeError, "the window meter's tokens was deleted");
        return -1;
    }
    *data_wait_s = self->data_wait_s;
    *fetched = self->fetched;
    *samples = self->samples;
    *tokens = self->tokens;  /* (its reference moves to the caller) */
    self->tokens = Py_NewRef(Py_None);
    self->data_wait_s = 0.0;
    self->fetched = 0;
    self->samples = 0;
    return 0;
}

static PyObject *
meter_take(Meter *self, PyObject *unused)
{
    double data_wait_s;
    Py_ssize_t fetched, samples;
    PyObject *tokens;
    if (meter_take_values((PyObject *)self, &data_wait_s, &fetched, &samples, &tokens) < 0)
        return NULL;
    return Py_BuildValue("(dnnN)", data_wait_s, fetched, samples, tokens);
}

static PyMethodDef meter_methods[] = {
    {"add", (PyCFunction)(void (*)(void))meter_add_method, METH_FASTCALL,
     "add(batch, wait_s)\n--\n\nCount one fetched micro-batch that took ``wait_s`` seconds "
     "to arrive."},
    {"timed_next", (PyCFunction)meter_timed_next, METH_O,
     "timed_next(iterator)\n--\n\n``next(iterator)``, timed and counted (StopIteration "
     "passes through)."},
    {"take", (PyCFunction)meter_take, METH_NOARGS,
     "take()\n--\n\n``(data_wait_s, fetched, samples, tokens)`` of the window that just "
     "ended, and a fresh start for the next one."},
    {NULL},
};

static PyMemberDef meter_members[] = {
    {"count_samples", T_OBJECT_EX, offsetof(Meter, count_samples), READONLY,
     "batch -> samples"},
    {"tokens_per_sample", T_OBJECT_EX, offsetof(Meter, tokens_per_sample), READONLY,
     "tokens in one sample, or None to count input_ids"},
    {"data_wait_s", T_DOUBLE, offsetof(Meter, data_wait_s), 0,
     "host seconds inside the window's fetches"},
    {"fetched", T_PYSSIZET, offsetof(Meter, fetched), 0, "micro-batches fetched"},
    {"samples", T_PYSSIZET, offsetof(Meter, samples), 0, "samples in them"},
    {"tokens", T_OBJECT_EX, offsetof(Meter, tokens), 0, "tokens in them, or None"},
    {NULL},
};

static PyTypeObject MeterType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "gpuopt._hotpath.WindowMeter",
    .tp_doc = PyDoc_STR(
        "WindowMeter(count_samples, tokens_per_sample=None)\n--\n\n"
        "What the accumulation window in progress fetched: data wait, micro-batches, "
        "samples, tokens.\n\n"
        "Data wait: host seconds inside the fetch of each micro-batch. Tokens: from shapes "
        "only, ``samples * tokens_per_sample`` when declared, else the number of elements "
        "of a mapping's ``input_ids`` (as Hugging Face batches have; padding included, as "
        "``transformers.Trainer``'s ``num_input_tokens_seen``), else none (:attr:`tokens` "
        "stays None).\n\n"
        "Args:\n"
        "    count_samples: ``batch -> samples`` (e.g. :func:`gpuopt.data.batch_size`: dim 0 "
        "of the first tensor, which is read here without a call for a tuple or list "
        "whose first item is a tensor).\n"
        "    tokens_per_sample: tokens in one sample, for token models whose batches carry "
        "no ``input_ids``; None to count from ``input_ids``.\n\n"
        "Raises:\n"
        "    ValueError: ``tokens_per_sample`` is not None or an integer >= 1.\n"
        "    TypeError: ``count_samples`` is not callable.\n\n"
        ".. note:: :meth:`add` runs no Python code for a tuple or list batch, and no torch "
        "call where its first tensor's dim 0 is read from the tensor's C++ object (a dense "
        "tensor of 1 to 5 dims; see gpuopt/_hotpath.c): tens of ns on the host; nothing "
        "reads tensor data."),
    .tp_basicsize = sizeof(Meter),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)meter_init,
    .tp_traverse = (traverseproc)meter_traverse,
    .tp_clear = (inquiry)meter_clear,
    .tp_dealloc = (destructor)meter_dealloc,
    .tp_methods = meter_methods,
    .tp_members = meter_members,
};

/* ------------------------------------------------------------------ Fetches */

typedef struct {
    PyObject_HEAD
    Counts *position;
    Meter *meter;         /* on_batch is this meter's add: called without a frame */
    PyObject *on_batch;   /* another on_batch(batch, wait_s), or NULL */
    PyObject *inner;      /* the epoch's iterator in the steady state, or NULL */
    PyObject *slow;       /* the generator of everything else, or NULL once ended */
    char running;         /* a next() is under way (a reentrant one, or a close, is refused) */
    PyObject *weakrefs;
} Fetches;

static PyTypeObject FetchesType;

static PyObject *
fetches_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    PyObject *position, *slow, *on_batch = Py_None;
    static char *names[] = {"position", "slow", "on_batch", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!O|O:Fetches", names, &CountsType,
                                     &position, &slow, &on_batch))
        return NULL;
    if (!PyGen_Check(slow)) {
        PyErr_SetString(PyExc_TypeError, "Fetches needs a generator");
        return NULL;
    }
    Fetches *self = (Fetches *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->position = (Counts *)Py_NewRef(position);
    self->slow = Py_NewRef(slow);
    if (PyCFunction_Check(on_batch) && PyCFunction_GET_SELF(on_batch) != NULL
            && Py_IS_TYPE(PyCFunction_GET_SELF(on_batch), &MeterType)
            && PyCFunction_GET_FUNCTION(on_batch) == (PyCFunction)(void (*)(void))meter_add_method)
        self->meter = (Meter *)Py_NewRef(PyCFunction_GET_SELF(on_batch));
    else if (on_batch != Py_None)
        self->on_batch = Py_NewRef(on_batch);
    return (PyObject *)self;
}

static int
fetches_traverse(Fetches *self, visitproc visit, void *arg)
{
    Py_VISIT(self->position);
    Py_VISIT(self->meter);
    Py_VISIT(self->on_batch);
    Py_VISIT(self->inner);
    Py_VISIT(self->slow);
    return 0;
}

static int
fetches_clear(Fetches *self)
{
    Py_CLEAR(self->position);
    Py_CLEAR(self->meter);
    Py_CLEAR(self->on_batch);
    Py_CLEAR(self->inner);
    Py_CLEAR(self->slow);
    return 0;
}

static void
fetches_dealloc(Fetches *self)
{
    PyObject_GC_UnTrack(self);
    if (self->weakrefs != NULL)
        PyObject_ClearWeakRefs((PyObject *)self);
    fetches_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);  /* (a subclass's type: its own dealloc's) */
}

/* The iteration ends: its generator closed (an error in flight is kept). */
static int
fetches_end(Fetches *self)
{
    Py_CLEAR(self->inner);
    PyObject *slow = self->slow;
    if (slow == NULL)
        return 0;
    self->slow = NULL;
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyObject *closed = PyObject_CallMethodNoArgs(slow, str_close);
    Py_DECREF(slow);
    if (closed == NULL && type == NULL)
        return -1;
    if (closed == NULL)  /* (the first error is the one to pass on) */
        PyErr_Clear();
    Py_XDECREF(closed);
    PyErr_Restore(type, value, traceback);
    return type == NULL ? 0 : -1;
}

/* Resume the generator, sending ``ended`` (the steady state found the epoch's end); it
 * yields ``[batch, iterator]``, iterator None unless the steady state may take over. */
static PyObject *
fetches_resume(Fetches *self, PyObject *ended)
{
    PyObject *yielded = NULL;
    PyObject *slow = Py_NewRef(self->slow);  /* (alive while it runs, whatever happens) */
    PySendResult result = PyIter_Send(slow, ended, &yielded);
    Py_DECREF(slow);
    if (result != PYGEN_NEXT) {
        Py_XDECREF(yielded);  /* (the generator's return value: None) */
        fetches_end(self);
        return NULL;  /* StopIteration, or the error set */
    }
    if (!PyList_CheckExact(yielded) || PyList_GET_SIZE(yielded) != 2) {
        Py_DECREF(yielded);
        PyErr_SetString(PyExc_SystemError, "Fetches: the generator yields [batch, iterator]");
        fetches_end(self);
        return NULL;
    }
    PyObject *batch = Py_NewRef(PyList_GET_ITEM(yielded, 0));
    PyObject *iterator = PyList_GET_ITEM(yielded, 1);
    if (iterator != Py_None && PyIter_Check(iterator))
        Py_XSETREF(self->inner, Py_NewRef(iterator));
    /* (emptied: the generator keeps no batch while this one fetches the next) */
    int emptied = PyList_SetSlice(yielded, 0, 2, NULL);
    Py_DECREF(yielded);
    if (emptied < 0) {
        Py_DECREF(batch);
        fetches_end(self);
        return NULL;
    }
    return batch;
}

static PyObject *
fetches_fetch(Fetches *self)
{
    if (self->slow == NULL)
        return NULL;
    Counts *position = self->position;
    if (self->inner == NULL)
        return fetches_resume(self, Py_None);
    if (position->restored != Py_None || position->dropping) {
        Py_CLEAR(self->inner);  /* (the generator goes back, or drops) */
        return fetches_resume(self, Py_None);
    }
    PyObject *inner = Py_NewRef(self->inner);  /* (alive while it runs, whatever happens) */
    double start = now_s();
    PyObject *batch = Py_TYPE(inner)->tp_iternext(inner);
    double wait_s = now_s() - start;
    Py_DECREF(inner);
    if (batch == NULL) {
        if (PyErr_Occurred()) {
            if (!PyErr_ExceptionMatches(PyExc_StopIteration)) {
                fetches_end(self);
                return NULL;
            }
            PyErr_Clear();
        }
        Py_CLEAR(self->inner);
        return fetches_resume(self, Py_True);
    }
    if (counts_count(position, batch, str_empty) < 0)
        goto failed;
    if (self->meter != NULL) {
        if (meter_add(self->meter, batch, wait_s) < 0)
            goto failed;
    }
    else if (self->on_batch != NULL) {
        PyObject *wait = PyFloat_FromDouble(wait_s);
        if (wait == NULL)
            goto failed;
        PyObject *args[2] = {batch, wait};
        PyObject *done = PyObject_Vectorcall(self->on_batch, args, 2, NULL);
        Py_DECREF(wait);
        if (done == NULL)
            goto failed;
        Py_DECREF(done);
    }
    return batch;
failed:
    Py_DECREF(batch);
    fetches_end(self);
    return NULL;
}

/* A generator's answer to a next() or a close() while it runs (from the loader's own
 * code, or from another thread while the fetch waits without the GIL). */
static int
fetches_refuse_running(Fetches *self)
{
    if (!self->running)
        return 0;
    PyErr_SetString(PyExc_ValueError, "the iteration is already fetching (a next() or close() "
                    "from inside its loader, or from another thread during a fetch)");
    return -1;
}

static PyObject *
fetches_next(Fetches *self)
{
    if (fetches_refuse_running(self) < 0)
        return NULL;
    self->running = 1;
    PyObject *batch = fetches_fetch(self);
    self->running = 0;
    return batch;
}

static PyObject *
fetches_close(Fetches *self, PyObject *unused)
{
    if (fetches_refuse_running(self) < 0 || fetches_end(self) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef fetches_methods[] = {
    {"close", (PyCFunction)fetches_close, METH_NOARGS,
     "close()\n--\n\nEnd the iteration: its next ``next()`` raises StopIteration and "
     "nothing more is fetched."},
    {NULL},
};

static PyTypeObject FetchesType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "gpuopt._hotpath.Fetches",
    .tp_doc = PyDoc_STR(
        "Fetches(position, slow, on_batch=None)\n--\n\n"
        "The iteration of :meth:`gpuopt.position.DataPosition.iterate`: its steady state "
        "in C, the rest in the generator ``slow``.\n\n"
        "``slow`` yields ``[batch, iterator]`` (emptied here as it is taken), each batch "
        "counted and timed already; "
        "``iterator`` not None hands the epoch's iterator over: the next batches are "
        "fetched here, each ``next()`` timed (the data wait), counted in ``position`` "
        "(a :class:`PositionCounts`) and given to ``on_batch(batch, wait_s)`` (a "
        ":class:`WindowMeter`'s ``add`` is called without a frame), until the epoch ends "
        "(``slow`` is resumed with True), or a restored position or batches to drop wait "
        "(``slow`` is resumed with None, as after any batch it yielded). An error of the "
        "iterator or of ``on_batch`` ends the iteration, as it ends a generator.\n\n"
        "Raises:\n"
        "    ValueError: ``next()`` or ``close()`` while a fetch runs (called from inside "
        "the loader, or from another thread while the fetch waits), as a running "
        "generator refuses; the iteration goes on.\n"
        "    TypeError: ``position`` is not a PositionCounts, or ``slow`` not a "
        "generator.\n\n"
        ".. note:: In the steady state a fetch runs no Python code besides the iterator's "
        "own: two clock reads, two counter additions, a deque append and the meter's "
        "sums."),
    .tp_basicsize = sizeof(Fetches),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = fetches_new,
    .tp_traverse = (traverseproc)fetches_traverse,
    .tp_clear = (inquiry)fetches_clear,
    .tp_dealloc = (destructor)fetches_dealloc,
    .tp_iter = PyObject_SelfIter,
    .tp_iternext = (iternextfunc)fetches_next,
    .tp_methods = fetches_methods,
    .tp_weaklistoffset = offsetof(Fetches, weakrefs),
};

/* ------------------------------------------------------------------ module */

static PyMethodDef module_methods[] = {
    {"_direct_dim0", (PyCFunction)direct_dim0_method, METH_O,
     "_direct_dim0(tensor)\n--\n\nDim 0 of ``tensor`` as a fetch reads it from the "
     "tensor's C++ object (1 for 0 dims), or None where a fetch reads ``shape`` instead "
     "(not exactly a torch.Tensor, not a dense TensorImpl, more than 5 dims, or no layout "
     "learned). For tests."},
    {"_tensor_layout", (PyCFunction)tensor_layout, METH_NOARGS,
     "_tensor_layout()\n--\n\n``(impl_offset, sizes_offset, extra_meta_offset, "
     "storage_offset, storage_offset_offset, dtype_offset, key_set_offset, data_offset, "
     "nbytes_offset)`` in bytes as learned at import (the last two in a StorageImpl), or "
     "None where the probes did not confirm the first three (``shape`` is read); -1 for "
     "the scalar's part where they did not confirm it (``item()`` is called)."},
    {"_host_scalar", (PyCFunction)host_scalar_method, METH_O,
     "_host_scalar(tensor)\n--\n\nThe value of ``tensor`` as :func:`host_items` reads it "
     "from memory, or None where it calls ``item()``. For tests."},
    {"host_items", (PyCFunction)host_items, METH_O,
     "host_items(tensors)\n--\n\n"
     "The values of a sequence of tensors as a list, each as ``tensor.item()`` gives it: "
     "read from host memory for a 0-dim float32 or float64 CPU tensor (see gpuopt/"
     "_hotpath.c, \"A host scalar without a call\": about 0.02 us, not 0.17), else by "
     "``item()`` itself.\n\n"
     "Raises:\n"
     "    what ``item()`` raises (a tensor of more than one element: RuntimeError; not a "
     "tensor: AttributeError).\n\n"
     ".. note:: Never synchronizes a device: a tensor on one is read by its ``item()``, "
     "which does."},
    {NULL},
};

static struct PyModuleDef hotpath_module = {
    PyModuleDef_HEAD_INIT,
    .m_methods = module_methods,
    .m_name = "gpuopt._hotpath",
    .m_doc = "The per-fetch counting of a training loop, in C (see gpuopt/_hotpath.c).",
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__hotpath(void)
{
    PyObject *torch = PyImport_ImportModule("torch");
    if (torch == NULL)
        return NULL;
    tensor_type = PyObject_GetAttrString(torch, "Tensor");
    if (tensor_type == NULL) {
        Py_DECREF(torch);
        return NULL;
    }
    if ((str_item = PyUnicode_InternFromString("item")) == NULL) {
        Py_DECREF(torch);
        return NULL;
    }
    learn_layout(torch);
    learn_scalar_layout(torch);
    Py_DECREF(torch);
    PyObject *abc = PyImport_ImportModule("collections.abc");
    if (abc == NULL)
        return NULL;
    mapping_abc = PyObject_GetAttrString(abc, "Mapping");
    Py_DECREF(abc);
    if (mapping_abc == NULL)
        return NULL;
    if ((str_shape = PyUnicode_InternFromString("shape")) == NULL
            || (str_get = PyUnicode_InternFromString("get")) == NULL
            || (str_input_ids = PyUnicode_InternFromString("input_ids")) == NULL
            || (str_numel = PyUnicode_InternFromString("numel")) == NULL
            || (str_close = PyUnicode_InternFromString("close")) == NULL
            || (str_empty = PyUnicode_InternFromString("")) == NULL)
        return NULL;
    if (PyType_Ready(&CountsType) < 0 || PyType_Ready(&MeterType) < 0
            || PyType_Ready(&FetchesType) < 0)
        return NULL;
    PyObject *module = PyModule_Create(&hotpath_module);
    if (module == NULL)
        return NULL;
    static HotpathAPI api = {
        &CountsType, &MeterType, counts_done, meter_take_values, direct_scalar,
    };
    PyObject *capsule = PyCapsule_New(&api, HOTPATH_API_NAME, NULL);
    if (capsule == NULL
            || PyModule_AddObjectRef(module, "PositionCounts", (PyObject *)&CountsType) < 0
            || PyModule_AddObjectRef(module, "WindowMeter", (PyObject *)&MeterType) < 0
            || PyModule_AddObjectRef(module, "Fetches", (PyObject *)&FetchesType) < 0
            || PyModule_AddObjectRef(module, "_C_API", capsule) < 0) {
        Py_XDECREF(capsule);
        Py_DECREF(module);
        return NULL;
    }
    Py_DECREF(capsule);
    return module;
}
