/*
 * kvflow stream stamps: a bounded ring of slots stamped by CUDA host functions.
 *
 * Python reserves a free slot, then calls kvf_ring_launch(), which enqueues
 * kvf_stamp() on a CUDA stream through cuLaunchHostFunc (passed in as a plain
 * function pointer: this file needs no CUDA header and links nothing of CUDA).
 * When the stream reaches it, kvf_stamp() runs on the driver's callback thread:
 * it reads CLOCK_MONOTONIC (the clock of Python's time.monotonic_ns), appends
 * the slot to a completion log and writes the bus's eventfd. It never touches
 * Python, so no thread holding the GIL can ever block it.
 *
 * The completion log has one cell per slot. A slot is logged at most once per
 * launch and only freed by Python after it was drained, so the log can never
 * overrun the drainer. Host functions of one stream run one after another, so
 * the log holds each stream's stamps in stream order.
 *
 * The ring is reference counted: the owner holds one reference and every
 * launched, not yet run host function holds one. Whoever drops the last frees
 * it, so the memory (and the ring's own duplicate of the eventfd) outlives any
 * callback still queued on a stream, whenever the owner lets go.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

/* cuLaunchHostFunc(CUstream, CUhostFn, void *): returns a CUresult, 0 = success. */
typedef int (*kvf_launch_fn)(void *stream, void (*fn)(void *), void *user_data);

struct kvf_ring;

typedef struct kvf_slot {
    struct kvf_ring *ring;
    uint64_t ts_ns; /* written by kvf_stamp before the slot is logged */
    uint32_t index;
} kvf_slot;

typedef struct kvf_ring {
    _Atomic int64_t refs;
    _Atomic uint64_t head; /* next log position a host function claims */
    uint64_t tail;         /* next log position the (single) drainer reads */
    uint32_t capacity;
    int wake_fd; /* the ring's own duplicate of the bus's eventfd */
    kvf_launch_fn launch;
    _Atomic uint32_t *log; /* slot index + 1 per completed stamp; 0 = empty */
    kvf_slot *slots;
} kvf_ring;

static _Atomic int64_t kvf_live_rings;

static void kvf_ring_unref(kvf_ring *ring) {
    if (atomic_fetch_sub_explicit(&ring->refs, 1, memory_order_acq_rel) != 1) {
        return;
    }
    close(ring->wake_fd);
    free(ring->log);
    free(ring->slots);
    free(ring);
    atomic_fetch_sub_explicit(&kvf_live_rings, 1, memory_order_relaxed);
}

/* The CUDA host function: stamp, log, wake. user_data is a kvf_slot. */
void kvf_stamp(void *user_data) {
    kvf_slot *slot = user_data;
    kvf_ring *ring = slot->ring;
    struct timespec now;
    const uint64_t one = 1;

    clock_gettime(CLOCK_MONOTONIC, &now);
    slot->ts_ns = (uint64_t)now.tv_sec * 1000000000u + (uint64_t)now.tv_nsec;
    uint64_t pos = atomic_fetch_add_explicit(&ring->head, 1, memory_order_relaxed);
    atomic_store_explicit(&ring->log[pos % ring->capacity], slot->index + 1, memory_order_release);
    while (write(ring->wake_fd, &one, sizeof one) < 0 && errno == EINTR) {
    }
    kvf_ring_unref(ring);
}

/* A ring of `capacity` slots waking `wake_fd` (duplicated); NULL on bad input or no memory. */
kvf_ring *kvf_ring_create(uint32_t capacity, int wake_fd, kvf_launch_fn launch) {
    if (capacity == 0 || launch == NULL) {
        return NULL;
    }
    kvf_ring *ring = calloc(1, sizeof *ring);
    if (ring == NULL) {
        return NULL;
    }
    ring->log = calloc(capacity, sizeof *ring->log);
    ring->slots = calloc(capacity, sizeof *ring->slots);
    ring->wake_fd = fcntl(wake_fd, F_DUPFD_CLOEXEC, 0);
    if (ring->log == NULL || ring->slots == NULL || ring->wake_fd < 0) {
        if (ring->wake_fd >= 0) {
            close(ring->wake_fd);
        }
        free(ring->log);
        free(ring->slots);
        free(ring);
        return NULL;
    }
    for (uint32_t i = 0; i < capacity; i++) {
        ring->slots[i].ring = ring;
        ring->slots[i].index = i;
    }
    ring->capacity = capacity;
    ring->launch = launch;
    atomic_init(&ring->refs, 1);
    atomic_init(&ring->head, 0);
    atomic_fetch_add_explicit(&kvf_live_rings, 1, memory_order_relaxed);
    return ring;
}

/* Enqueue kvf_stamp for slot `index` on `stream`: 0, the launcher's error code, or -1 (bad slot). */
int kvf_ring_launch(kvf_ring *ring, uint32_t index, void *stream) {
    if (index >= ring->capacity) {
        return -1;
    }
    atomic_fetch_add_explicit(&ring->refs, 1, memory_order_relaxed);
    int rc = ring->launch(stream, kvf_stamp, &ring->slots[index]);
    if (rc != 0) {
        atomic_fetch_sub_explicit(&ring->refs, 1, memory_order_relaxed);
    }
    return rc;
}

/* Move up to `max` completed stamps, in completion order, into the two arrays. One drainer only. */
uint32_t kvf_ring_drain(kvf_ring *ring, uint32_t *out_index, uint64_t *out_ts, uint32_t max) {
    uint32_t n = 0;
    while (n < max) {
        _Atomic uint32_t *cell = &ring->log[ring->tail % ring->capacity];
        uint32_t logged = atomic_load_explicit(cell, memory_order_acquire);
        if (logged == 0) {
            break;
        }
        atomic_store_explicit(cell, 0, memory_order_relaxed);
        ring->tail++;
        out_index[n] = logged - 1;
        out_ts[n] = ring->slots[logged - 1].ts_ns;
        n++;
    }
    return n;
}

/* Drop the owner's reference; the ring is freed once no queued host function remains. */
void kvf_ring_release(kvf_ring *ring) { kvf_ring_unref(ring); }

/* Rings not yet freed in this process (lets tests check that nothing leaks or is freed early). */
int64_t kvf_live_ring_count(void) {
    return atomic_load_explicit(&kvf_live_rings, memory_order_relaxed);
}
