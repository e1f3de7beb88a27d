/*
 * kvflow stream lanes: the launching thread's half of GPU stream events, in C.
 *
 * A LaneTable keeps, per CUDA stream ("lane"), the FIFO of (CUDA event, bus Event)
 * recorded on that stream and not collected yet, and per CUDA context a pool of idle
 * CUDA events. `enqueue` is what EventBus.publish_on_stream calls: look the stream up,
 * reserve room on the bus, take a pooled CUDA event, cuEventRecord it, append, and wake
 * the dispatcher when no waker watches the stream. Anything unusual (a stream seen for
 * the first time, a default stream, an empty pool, a CUDA error) goes to a Python slow
 * path in stream.py.
 *
 * Every method runs holding the GIL, so the GIL orders them. Only the bus calls, the
 * slow path and CUDA entry points that tests fake in Python can let another thread run
 * mid-call; an enqueue keeps its lane marked in use across them, so a concurrent prune
 * never retires a lane an event is about to join. The dispatcher (stream.py) reads
 * completed events' GPU times through `head`/`pop` and arms the native wakers of
 * stream_wakers.c through `arm`.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <stdlib.h>

#include "stream_wakers.h"

/* cuEventRecord(CUevent, CUstream), cuCtxPushCurrent(CUcontext), cuCtxPopCurrent(CUcontext *) */
typedef int (*kvf_record_fn)(void *event, void *stream);
typedef int (*kvf_push_fn)(void *ctx);
typedef int (*kvf_pop_fn)(void **ctx);

/* enqueue outcomes; a positive value is the CUresult of a refused record */
enum {
    KVF_RECORDED = 0,
    KVF_DROPPED = -1,  /* no room on the bus (counted there) */
    KVF_NO_LANE = -2,  /* unknown or default stream, or a retired lane: resolve in Python */
    KVF_NO_EVENT = -3, /* the context's pool is empty: create a CUDA event in Python */
    KVF_ERROR = -4,    /* a Python exception is set */
};
#define KVF_CUDA_ERROR_INVALID_CONTEXT 201

typedef struct {
    void **items;
    Py_ssize_t len, cap;
} kvf_pool;

typedef struct {
    int open;
    int armed;
    int users; /* enqueues between their checks and their append */
    Py_ssize_t pool;
    void *ctx;
    void **cuda_events; /* FIFO: `count` cells from `head`, modulo `cap` */
    PyObject **events;
    Py_ssize_t head, count, cap;
} kvf_lane;

typedef struct {
    PyObject_HEAD
    kvf_ring *ring;
    kvf_record_fn record;
    kvf_push_fn push;
    kvf_pop_fn pop;
    PyObject *lanes_by_key; /* dict: stream key -> lane index; keys of int are CUstreams */
    PyObject *try_reserve;  /* bus.try_reserve(etype) -> bool */
    PyObject *release;      /* bus.release_reservation(etype) */
    PyObject *slow;         /* slow(stream, event, code) -> bool */
    kvf_lane *lanes;
    Py_ssize_t n_lanes;
    kvf_pool *pools;
    Py_ssize_t n_pools;
    Py_ssize_t pending;
    int wake_pending;
} LaneTable;

static PyObject *str_type, *str_ts_ns, *str_cuda_stream;

/* Add an event to a pool; -1 when out of memory (no Python exception set). */
static int pool_push(kvf_pool *pool, void *cuda_event) {
    if (pool->len == pool->cap) {
        Py_ssize_t cap = pool->cap ? 2 * pool->cap : 64;
        void **items = realloc(pool->items, (size_t)cap * sizeof *items);
        if (items == NULL) {
            return -1;
        }
        pool->items = items;
        pool->cap = cap;
    }
    pool->items[pool->len++] = cuda_event;
    return 0;
}

/* Make room for one more FIFO cell; -1 when out of memory (no Python exception set). */
static int lane_grow(kvf_lane *lane) {
    if (lane->count < lane->cap) {
        return 0;
    }
    Py_ssize_t cap = lane->cap ? 2 * lane->cap : 16;
    void **cuda_events = malloc((size_t)cap * sizeof *cuda_events);
    PyObject **events = malloc((size_t)cap * sizeof *events);
    if (cuda_events == NULL || events == NULL) {
        free(cuda_events);
        free(events);
        return -1;
    }
    for (Py_ssize_t i = 0; i < lane->count; i++) {
        Py_ssize_t at = (lane->head + i) % lane->cap;
        cuda_events[i] = lane->cuda_events[at];
        events[i] = lane->events[at];
    }
    free(lane->cuda_events);
    free(lane->events);
    lane->cuda_events = cuda_events;
    lane->events = events;
    lane->head = 0;
    lane->cap = cap;
    return 0;
}

static kvf_lane *open_lane_at(LaneTable *self, Py_ssize_t index) {
    if (index < 0 || index >= self->n_lanes || !self->lanes[index].open) {
        return NULL;
    }
    return &self->lanes[index];
}

/* Give back a CUDA event taken for a record that did not happen. Out of memory, the event
 * is lost to the pool (a later enqueue creates another); nothing else depends on it. */
static void give_back(LaneTable *self, kvf_lane *lane, void *cuda_event) {
    (void)pool_push(&self->pools[lane->pool], cuda_event);
}

/* Record `event` on lane `index` of stream `handle`: one of the KVF_ codes, or the CUresult
 * of a refused record (the reservation is then given back as a drop). */
static int lane_enqueue(LaneTable *self, Py_ssize_t index, void *handle, PyObject *event) {
    kvf_lane *lane = open_lane_at(self, index);
    if (lane == NULL) {
        return KVF_NO_LANE;
    }
    kvf_pool *pool = &self->pools[lane->pool];
    if (pool->len == 0) {
        return KVF_NO_EVENT;
    }
    PyObject *etype = PyObject_GetAttr(event, str_type);
    if (etype == NULL) {
        return KVF_ERROR;
    }
    void *cuda_event = pool->items[--pool->len];
    lane->users++;
    PyObject *ok = PyObject_CallOneArg(self->try_reserve, etype);
    int reserved = ok == NULL ? -1 : PyObject_IsTrue(ok);
    Py_XDECREF(ok);
    int rc = reserved == 1 ? self->record(cuda_event, handle) : KVF_DROPPED;
    if (rc == KVF_CUDA_ERROR_INVALID_CONTEXT && lane->ctx != NULL && self->push(lane->ctx) == 0) {
        /* a thread that never used CUDA: record again with the stream's context current */
        void *popped = NULL;
        rc = self->record(cuda_event, handle);
        self->pop(&popped);
    }
    int no_memory = rc == KVF_RECORDED && lane_grow(lane) < 0;
    if (no_memory) {
        rc = KVF_ERROR; /* the record on the stream is harmless; the event goes back unused */
    }
    lane->users--;
    if (rc != KVF_RECORDED) {
        give_back(self, lane, cuda_event);
        if (reserved == 1) {
            PyObject *done = PyObject_CallOneArg(self->release, etype);
            if (done == NULL) {
                rc = KVF_ERROR;
            }
            Py_XDECREF(done);
        }
        Py_DECREF(etype);
        if (no_memory && !PyErr_Occurred()) {
            PyErr_NoMemory();
        }
        return reserved < 0 ? KVF_ERROR : rc;
    }
    Py_DECREF(etype);
    Py_ssize_t at = (lane->head + lane->count) % lane->cap;
    lane->cuda_events[at] = cuda_event;
    Py_INCREF(event);
    lane->events[at] = event;
    lane->count++;
    self->pending++;
    if (!lane->armed && !self->wake_pending) {
        /* no waker watches this stream: ask the dispatcher to look */
        self->wake_pending = 1;
        kvf_ring_wake(self->ring);
    }
    return KVF_RECORDED;
}

static PyObject *LaneTable_enqueue(LaneTable *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "enqueue(stream, event) takes exactly 2 arguments");
        return NULL;
    }
    PyObject *stream = args[0], *event = args[1], *key;
    int code = KVF_NO_LANE;
    if (PyLong_CheckExact(stream)) {
        key = Py_NewRef(stream);
    } else {
        key = PyObject_GetAttr(stream, str_cuda_stream); /* a torch.cuda.Stream */
        if (key == NULL) {
            if (!PyErr_ExceptionMatches(PyExc_AttributeError)) {
                return NULL;
            }
            PyErr_Clear();
        } else if (!PyLong_CheckExact(key)) {
            Py_CLEAR(key);
        }
    }
    if (key != NULL) {
        PyObject *found = PyDict_GetItemWithError(self->lanes_by_key, key);
        if (found != NULL) {
            Py_ssize_t index = PyLong_AsSsize_t(found);
            void *handle = PyLong_AsVoidPtr(key);
            code = PyErr_Occurred() ? KVF_ERROR : lane_enqueue(self, index, handle, event);
        } else if (PyErr_Occurred()) {
            code = KVF_ERROR;
        }
        Py_DECREF(key);
    }
    if (code == KVF_RECORDED) {
        Py_RETURN_TRUE;
    }
    if (code == KVF_DROPPED) {
        Py_RETURN_FALSE;
    }
    if (code == KVF_ERROR) {
        return NULL;
    }
    return PyObject_CallFunction(self->slow, "OOi", stream, event, code);
}

static PyObject *LaneTable_enqueue_lane(LaneTable *self, PyObject *args) {
    Py_ssize_t index;
    unsigned long long handle;
    PyObject *event;
    if (!PyArg_ParseTuple(args, "nKO", &index, &handle, &event)) {
        return NULL;
    }
    int code = lane_enqueue(self, index, (void *)(uintptr_t)handle, event);
    return code == KVF_ERROR ? NULL : PyLong_FromLong(code);
}

static PyObject *LaneTable_open_lane(LaneTable *self, PyObject *args) {
    Py_ssize_t index, pool;
    PyObject *key;
    unsigned long long ctx;
    if (!PyArg_ParseTuple(args, "nOKn", &index, &key, &ctx, &pool)) {
        return NULL;
    }
    if (index < 0 || index >= self->n_lanes || self->lanes[index].open) {
        return PyErr_Format(PyExc_ValueError, "lane %zd is out of range or open", index);
    }
    if (pool < 0 || pool >= self->n_pools) {
        return PyErr_Format(PyExc_ValueError, "no event pool %zd", pool);
    }
    PyObject *value = PyLong_FromSsize_t(index);
    if (value == NULL || PyDict_SetItem(self->lanes_by_key, key, value) < 0) {
        Py_XDECREF(value);
        return NULL;
    }
    Py_DECREF(value);
    kvf_lane *lane = &self->lanes[index];
    lane->open = 1;
    lane->armed = 0;
    lane->pool = pool;
    lane->ctx = (void *)(uintptr_t)ctx;
    Py_RETURN_NONE;
}

static PyObject *LaneTable_close_lane(LaneTable *self, PyObject *args) {
    Py_ssize_t index;
    PyObject *key;
    if (!PyArg_ParseTuple(args, "nO", &index, &key)) {
        return NULL;
    }
    kvf_lane *lane = open_lane_at(self, index);
    if (lane == NULL || lane->armed || lane->count || lane->users) {
        Py_RETURN_FALSE;
    }
    if (PyDict_DelItem(self->lanes_by_key, key) < 0) {
        return NULL;
    }
    lane->open = 0;
    Py_RETURN_TRUE;
}

static PyObject *LaneTable_add_pool(LaneTable *self, PyObject *Py_UNUSED(ignored)) {
    kvf_pool *pools = realloc(self->pools, (size_t)(self->n_pools + 1) * sizeof *pools);
    if (pools == NULL) {
        return PyErr_NoMemory();
    }
    pools[self->n_pools] = (kvf_pool){NULL, 0, 0};
    self->pools = pools;
    return PyLong_FromSsize_t(self->n_pools++);
}

static PyObject *LaneTable_give(LaneTable *self, PyObject *args) {
    Py_ssize_t pool;
    unsigned long long cuda_event;
    if (!PyArg_ParseTuple(args, "nK", &pool, &cuda_event)) {
        return NULL;
    }
    if (pool < 0 || pool >= self->n_pools || cuda_event == 0) {
        return PyErr_Format(PyExc_ValueError, "no event pool %zd, or a null event", pool);
    }
    if (pool_push(&self->pools[pool], (void *)(uintptr_t)cuda_event) < 0) {
        return PyErr_NoMemory();
    }
    Py_RETURN_NONE;
}

/* Append `value` to `list` as a Python int; -1 with an exception set on failure. */
static int append_int(PyObject *list, PyObject *value) {
    if (value == NULL) {
        return -1;
    }
    int rc = PyList_Append(list, value);
    Py_DECREF(value);
    return rc;
}

static PyObject *LaneTable_drain(LaneTable *self, PyObject *Py_UNUSED(ignored)) {
    uint32_t batch[256];
    PyObject *out = PyList_New(0);
    if (out == NULL) {
        return NULL;
    }
    self->wake_pending = 0;
    uint32_t n;
    do {
        n = kvf_ring_drain(self->ring, batch, 256);
        for (uint32_t i = 0; i < n; i++) {
            if (append_int(out, PyLong_FromUnsignedLong(batch[i])) < 0) {
                Py_DECREF(out);
                return NULL;
            }
            self->lanes[batch[i]].armed = 0;
        }
    } while (n == 256);
    return out;
}

static int lane_arg(LaneTable *self, PyObject *arg, kvf_lane **lane) {
    Py_ssize_t index = PyLong_AsSsize_t(arg);
    if (index == -1 && PyErr_Occurred()) {
        return -1;
    }
    *lane = open_lane_at(self, index);
    if (*lane == NULL) {
        PyErr_Format(PyExc_ValueError, "lane %zd is not open", index);
        return -1;
    }
    return 0;
}

static PyObject *LaneTable_head(LaneTable *self, PyObject *arg) {
    kvf_lane *lane;
    if (lane_arg(self, arg, &lane) < 0) {
        return NULL;
    }
    return PyLong_FromVoidPtr(lane->count ? lane->cuda_events[lane->head] : NULL);
}

static PyObject *LaneTable_pop(LaneTable *self, PyObject *const *args, Py_ssize_t nargs) {
    kvf_lane *lane;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "pop(lane, ts_ns) takes exactly 2 arguments");
        return NULL;
    }
    if (lane_arg(self, args[0], &lane) < 0) {
        return NULL;
    }
    if (lane->count == 0) {
        PyErr_SetString(PyExc_IndexError, "pop from an empty lane");
        return NULL;
    }
    PyObject *event = lane->events[lane->head];
    if (PyObject_SetAttr(event, str_ts_ns, args[1]) < 0) {
        return NULL;
    }
    if (pool_push(&self->pools[lane->pool], lane->cuda_events[lane->head]) < 0) {
        return PyErr_NoMemory();
    }
    lane->head = (lane->head + 1) % lane->cap;
    lane->count--;
    self->pending--;
    return event; /* the FIFO's reference passes to the caller */
}

static PyObject *LaneTable_pending(LaneTable *self, PyObject *arg) {
    Py_ssize_t index = PyLong_AsSsize_t(arg);
    if (index == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (index < 0) {
        return PyLong_FromSsize_t(self->pending);
    }
    kvf_lane *lane = open_lane_at(self, index);
    return PyLong_FromSsize_t(lane == NULL ? 0 : lane->count);
}

static PyObject *LaneTable_armed(LaneTable *self, PyObject *arg) {
    kvf_lane *lane;
    if (lane_arg(self, arg, &lane) < 0) {
        return NULL;
    }
    return PyBool_FromLong(lane->armed);
}

static PyObject *LaneTable_arm(LaneTable *self, PyObject *args) {
    Py_ssize_t index;
    unsigned long long side;
    if (!PyArg_ParseTuple(args, "nK", &index, &side)) {
        return NULL;
    }
    kvf_lane *lane = open_lane_at(self, index);
    if (lane == NULL || lane->count == 0 || lane->armed) {
        return PyErr_Format(PyExc_ValueError, "lane %zd has nothing to arm a waker on", index);
    }
    int rc = kvf_ring_arm(self->ring, (uint32_t)index, (void *)(uintptr_t)side,
                          lane->cuda_events[lane->head]);
    if (rc == 0) {
        lane->armed = 1;
    }
    return PyLong_FromLong(rc);
}

/* Every CUDA event the table holds, pooled or queued; queued bus events are let go. */
static PyObject *LaneTable_take_all(LaneTable *self, PyObject *Py_UNUSED(ignored)) {
    PyObject *out = PyList_New(0);
    if (out == NULL) {
        return NULL;
    }
    for (Py_ssize_t p = 0; p < self->n_pools; p++) {
        kvf_pool *pool = &self->pools[p];
        while (pool->len) {
            if (append_int(out, PyLong_FromVoidPtr(pool->items[pool->len - 1])) < 0) {
                Py_DECREF(out);
                return NULL;
            }
            pool->len--;
        }
    }
    for (Py_ssize_t i = 0; i < self->n_lanes; i++) {
        kvf_lane *lane = &self->lanes[i];
        while (lane->count) {
            if (append_int(out, PyLong_FromVoidPtr(lane->cuda_events[lane->head])) < 0) {
                Py_DECREF(out);
                return NULL;
            }
            Py_DECREF(lane->events[lane->head]);
            lane->head = (lane->head + 1) % lane->cap;
            lane->count--;
            self->pending--;
        }
    }
    return out;
}

static int LaneTable_init(LaneTable *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"max_lanes", "wake_fd", "record_ptr", "push_ptr", "pop_ptr",
                             "launch_ptr", "wait_ptr", "lanes_by_key", "try_reserve",
                             "release", "slow", NULL};
    Py_ssize_t n_lanes;
    int wake_fd;
    unsigned long long record, push, pop, launch, wait;
    PyObject *lanes_by_key, *try_reserve, *release, *slow;
    if (self->ring != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "LaneTable is already initialised");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "niKKKKKO!OOO", kwlist, &n_lanes, &wake_fd,
                                     &record, &push, &pop, &launch, &wait, &PyDict_Type,
                                     &lanes_by_key, &try_reserve, &release, &slow)) {
        return -1;
    }
    if (n_lanes < 1 || n_lanes > UINT32_MAX) {
        PyErr_Format(PyExc_ValueError, "max_lanes must be in [1, 2**32), got %zd", n_lanes);
        return -1;
    }
    if (!record || !push || !pop || !launch || !wait) {
        PyErr_SetString(PyExc_ValueError, "every CUDA entry point must be a non-null address");
        return -1;
    }
    self->lanes = calloc((size_t)n_lanes, sizeof *self->lanes);
    if (self->lanes == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    self->ring = kvf_ring_create((uint32_t)n_lanes, wake_fd, (kvf_launch_fn)(uintptr_t)launch,
                                 (kvf_wait_fn)(uintptr_t)wait);
    if (self->ring == NULL) {
        PyErr_Format(PyExc_OSError, "kvf_ring_create(%zd) failed (no memory or bad wake fd %d)",
                     n_lanes, wake_fd);
        return -1;
    }
    self->n_lanes = n_lanes;
    self->record = (kvf_record_fn)(uintptr_t)record;
    self->push = (kvf_push_fn)(uintptr_t)push;
    self->pop = (kvf_pop_fn)(uintptr_t)pop;
    self->lanes_by_key = Py_NewRef(lanes_by_key);
    self->try_reserve = Py_NewRef(try_reserve);
    self->release = Py_NewRef(release);
    self->slow = Py_NewRef(slow);
    return 0;
}

static int LaneTable_traverse(LaneTable *self, visitproc visit, void *arg) {
    Py_VISIT(self->lanes_by_key);
    Py_VISIT(self->try_reserve);
    Py_VISIT(self->release);
    Py_VISIT(self->slow);
    return 0;
}

static int LaneTable_clear(LaneTable *self) {
    Py_CLEAR(self->lanes_by_key);
    Py_CLEAR(self->try_reserve);
    Py_CLEAR(self->release);
    Py_CLEAR(self->slow);
    return 0;
}

static void LaneTable_dealloc(LaneTable *self) {
    PyObject_GC_UnTrack(self);
    LaneTable_clear(self);
    for (Py_ssize_t i = 0; i < self->n_lanes; i++) {
        kvf_lane *lane = &self->lanes[i];
        for (Py_ssize_t k = 0; k < lane->count; k++) {
            Py_DECREF(lane->events[(lane->head + k) % lane->cap]);
        }
        free(lane->cuda_events);
        free(lane->events);
    }
    free(self->lanes);
    for (Py_ssize_t p = 0; p < self->n_pools; p++) {
        free(self->pools[p].items);
    }
    free(self->pools);
    if (self->ring != NULL) {
        kvf_ring_release(self->ring); /* armed wakers keep it alive until they ran */
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

#define FASTCALL(fn) (PyCFunction)(void (*)(void))(fn), METH_FASTCALL

static PyMethodDef LaneTable_methods[] = {
    {"enqueue", FASTCALL(LaneTable_enqueue),
     "enqueue(stream, event) -> bool: record `event` on `stream` (False: dropped)."},
    {"enqueue_lane", (PyCFunction)LaneTable_enqueue_lane, METH_VARARGS,
     "enqueue_lane(lane, handle, event) -> int: enqueue on a known lane; 0 recorded, -1 dropped, "
     "-2 no such lane, -3 no pooled CUDA event, > 0 the CUresult of a refused record."},
    {"open_lane", (PyCFunction)LaneTable_open_lane, METH_VARARGS,
     "open_lane(lane, key, ctx, pool): serve stream `key` on lane `lane`."},
    {"close_lane", (PyCFunction)LaneTable_close_lane, METH_VARARGS,
     "close_lane(lane, key) -> bool: retire an idle lane (False while it has work)."},
    {"add_pool", (PyCFunction)LaneTable_add_pool, METH_NOARGS,
     "add_pool() -> int: a new, empty CUDA event pool (one per context)."},
    {"give", (PyCFunction)LaneTable_give, METH_VARARGS, "give(pool, cuda_event): pool an event."},
    {"drain", (PyCFunction)LaneTable_drain, METH_NOARGS,
     "drain() -> list[int]: lanes whose waker ran (now disarmed)."},
    {"head", (PyCFunction)LaneTable_head, METH_O,
     "head(lane) -> int: the oldest pending CUDA event of `lane`, 0 if none."},
    {"pop", FASTCALL(LaneTable_pop),
     "pop(lane, ts_ns) -> Event: remove the oldest pending event, stamped `ts_ns`."},
    {"pending", (PyCFunction)LaneTable_pending, METH_O,
     "pending(lane) -> int: events pending on `lane` (all lanes if negative)."},
    {"armed", (PyCFunction)LaneTable_armed, METH_O, "armed(lane) -> bool"},
    {"arm", (PyCFunction)LaneTable_arm, METH_VARARGS,
     "arm(lane, side_stream) -> int: arm the lane's waker on its oldest pending event."},
    {"take_all", (PyCFunction)LaneTable_take_all, METH_NOARGS,
     "take_all() -> list[int]: every CUDA event held, for destruction; pending events are let go."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject LaneTableType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "_kvflow_stream.LaneTable",
    .tp_doc = "Per-stream FIFOs of recorded CUDA events and per-context event pools.",
    .tp_basicsize = sizeof(LaneTable),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)LaneTable_init,
    .tp_dealloc = (destructor)LaneTable_dealloc,
    .tp_traverse = (traverseproc)LaneTable_traverse,
    .tp_clear = (inquiry)LaneTable_clear,
    .tp_methods = LaneTable_methods,
};

static PyObject *live_rings(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(ignored)) {
    return PyLong_FromLongLong(kvf_live_ring_count());
}

static PyMethodDef module_methods[] = {
    {"live_rings", live_rings, METH_NOARGS, "Rings not yet freed in this process."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_kvflow_stream",
    .m_doc = "kvflow's native stream-event lanes and wakers (see stream_lanes.c).",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC PyInit__kvflow_stream(void) {
    if (PyType_Ready(&LaneTableType) < 0) {
        return NULL;
    }
    str_type = PyUnicode_InternFromString("type");
    str_ts_ns = PyUnicode_InternFromString("ts_ns");
    str_cuda_stream = PyUnicode_InternFromString("cuda_stream");
    if (str_type == NULL || str_ts_ns == NULL || str_cuda_stream == NULL) {
        return NULL;
    }
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL) {
        return NULL;
    }
    if (PyModule_AddObjectRef(module, "LaneTable", (PyObject *)&LaneTableType) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
