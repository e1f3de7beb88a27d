/*
 * kvflow stream wakers: native CUDA host functions that wake the event bus.
 *
 * A stream event's time comes from a CUDA event recorded on its stream (the
 * GPU's own timestamp). To learn without polling that it completed, the bus's
 * dispatcher "arms" a waker: kvf_ring_arm() makes a side stream wait for that
 * CUDA event (cuStreamWaitEvent) and enqueues kvf_wake() behind the wait
 * (cuLaunchHostFunc); both are passed in as plain function pointers, so this
 * file needs no CUDA header and links nothing of CUDA. kvf_wake() runs on the
 * driver's callback thread: it appends its slot to a completion log and writes
 * the bus's eventfd. It never touches Python, so no thread holding the GIL can
 * ever block it, and the work stream itself never waits for the host.
 *
 * The completion log has one cell per slot. A slot is armed at most once at a
 * time and re-armed only after it was drained, so the log can never overrun
 * the single drainer.
 *
 * The ring is reference counted: the owner holds one reference and every armed
 * waker that has not run yet holds one. Whoever drops the last frees it, so the
 * memory (and the ring's own duplicate of the eventfd) outlives any waker still
 * queued on a stream, whenever the owner lets go.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <unistd.h>

#include "stream_wakers.h"

typedef struct kvf_slot {
    struct kvf_ring *ring;
    uint32_t index;
} kvf_slot;

struct kvf_ring {
    _Atomic int64_t refs;
    _Atomic uint64_t head; /* next log position a waker claims */
    uint64_t tail;         /* next log position the (single) drainer reads */
    uint32_t capacity;
    int wake_fd; /* the ring's own duplicate of the bus's eventfd */
    kvf_launch_fn launch;
    kvf_wait_fn wait;
    _Atomic uint32_t *log; /* slot index + 1 per run waker; 0 = empty */
    kvf_slot *slots;
};

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

/* Write the bus's eventfd. Also called by the launching thread (stream_lanes.c), which keeps
 * the GIL, so it hands the GIL to no one just to wake the dispatcher. */
void kvf_ring_wake(kvf_ring *ring) {
    const uint64_t one = 1;
    while (write(ring->wake_fd, &one, sizeof one) < 0 && errno == EINTR) {
    }
}

/* The CUDA host function: log the slot, wake the bus. user_data is a kvf_slot. */
void kvf_wake(void *user_data) {
    kvf_slot *slot = user_data;
    kvf_ring *ring = slot->ring;

    uint64_t pos = atomic_fetch_add_explicit(&ring->head, 1, memory_order_relaxed);
    atomic_store_explicit(&ring->log[pos % ring->capacity], slot->index + 1, memory_order_release);
    kvf_ring_wake(ring);
    kvf_ring_unref(ring);
}

/* A ring of `capacity` slots waking `wake_fd` (duplicated); NULL on bad input or no memory. */
kvf_ring *kvf_ring_create(uint32_t capacity, int wake_fd, kvf_launch_fn launch, kvf_wait_fn wait) {
    if (capacity == 0 || launch == NULL || wait == NULL) {
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
    ring->wait = wait;
    atomic_init(&ring->refs, 1);
    atomic_init(&ring->head, 0);
    atomic_fetch_add_explicit(&kvf_live_rings, 1, memory_order_relaxed);
    return ring;
}

/* Make `stream` wait for `event`, then enqueue kvf_wake for slot `index` on it.
 * Returns 0, the driver's error code, or -1 for a bad slot. */
int kvf_ring_arm(kvf_ring *ring, uint32_t index, void *stream, void *event) {
    if (index >= ring->capacity) {
        return -1;
    }
    int rc = ring->wait(stream, event, 0);
    if (rc != 0) {
        return rc;
    }
    atomic_fetch_add_explicit(&ring->refs, 1, memory_order_relaxed);
    rc = ring->launch(stream, kvf_wake, &ring->slots[index]);
    if (rc != 0) {
        atomic_fetch_sub_explicit(&ring->refs, 1, memory_order_relaxed);
    }
    return rc;
}

/* Move up to `max` run wakers' slot indices, in run order, into `out`. One drainer only. */
uint32_t kvf_ring_drain(kvf_ring *ring, uint32_t *out, uint32_t max) {
    uint32_t n = 0;
    while (n < max) {
        _Atomic uint32_t *cell = &ring->log[ring->tail % ring->capacity];
        uint32_t logged = atomic_load_explicit(cell, memory_order_acquire);
        if (logged == 0) {
            break;
        }
        atomic_store_explicit(cell, 0, memory_order_relaxed);
        ring->tail++;
        out[n++] = logged - 1;
    }
    return n;
}

/* Drop the owner's reference; the ring is freed once no armed waker remains. */
void kvf_ring_release(kvf_ring *ring) { kvf_ring_unref(ring); }

/* Rings not yet freed in this process (lets tests check that nothing leaks or is freed early). */
int64_t kvf_live_ring_count(void) {
    return atomic_load_explicit(&kvf_live_rings, memory_order_relaxed);
}
