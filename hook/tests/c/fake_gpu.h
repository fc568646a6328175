/* A fake GPU shared by every process of a test (a file mapped shared, $FAKE_GPU_STATE): its
 * memory, the processes with a context, and a timeline on which kernels run one after another,
 * so utilization is the busy share of wall time. Used by the fake libcuda, the fake NVML and
 * the test client. */
#pragma once
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define FAKE_MAX_PROCS 64

struct fake_gpu {
    uint64_t memory_total;
    uint64_t memory_used;
    uint64_t next_ptr;
    uint32_t lock;
    uint32_t nprocs;
    uint32_t pids[FAKE_MAX_PROCS];
    uint64_t busy_ns[FAKE_MAX_PROCS];
    uint64_t busy_total_ns;
    uint64_t busy_until_ns;
    uint64_t launches;
    /* Device memory each process holds (its allocations, its pools, its context). */
    uint64_t proc_mem[FAKE_MAX_PROCS];
};

static inline uint64_t fake_now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

static inline struct fake_gpu *fake_gpu(void) {
    static struct fake_gpu *g;
    if (g) return g;
    const char *path = getenv("FAKE_GPU_STATE");
    if (!path) abort();
    int fd = open(path, O_RDWR | O_CREAT, 0644);
    if (fd < 0) abort();
    if (ftruncate(fd, sizeof(struct fake_gpu)) != 0) abort();
    g = mmap(NULL, sizeof(struct fake_gpu), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (g == MAP_FAILED) abort();
    return g;
}

static inline void fake_lock(struct fake_gpu *g) {
    while (__atomic_exchange_n(&g->lock, 1, __ATOMIC_ACQUIRE)) {
        struct timespec t = {0, 1000};
        nanosleep(&t, NULL);
    }
}

static inline void fake_unlock(struct fake_gpu *g) {
    __atomic_store_n(&g->lock, 0, __ATOMIC_RELEASE);
}

/* Adds `delta` to the calling process's memory (the lock held). */
static inline void fake_own_mem(struct fake_gpu *g, int64_t delta);

/* The slot of `pid` (registered on first use). */
static inline int fake_proc(struct fake_gpu *g, uint32_t pid) {
    for (uint32_t i = 0; i < g->nprocs; i++)
        if (g->pids[i] == pid) return (int)i;
    if (g->nprocs == FAKE_MAX_PROCS) return -1;
    g->pids[g->nprocs] = pid;
    return (int)g->nprocs++;
}

static inline void fake_own_mem(struct fake_gpu *g, int64_t delta) {
    int p = fake_proc(g, (uint32_t)getpid());
    if (p >= 0) g->proc_mem[p] += (uint64_t)delta;
}
