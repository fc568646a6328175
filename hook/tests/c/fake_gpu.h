/* A fake GPU shared by every process of a test (a file mapped shared, $FAKE_GPU_STATE): its
 * memory, the processes with a context, and a timeline on which kernels run one after another,
 * so utilization is the busy share of wall time. Under $FAKE_MPS the card serves its processes
 * as MPS does: each has a timeline of its own, run beside the others', and its kernels take
 * 100 / $CUDA_MPS_ACTIVE_THREAD_PERCENTAGE times as long (it has that share of the SMs); the
 * processes' percentages are assumed to sum to 100 at most (no contention is modelled). Used by the fake libcuda, the fake NVML and
 * the test client. */
#pragma once
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define FAKE_MAX_PROCS 64
#define FAKE_MAX_CGROUPS 16
#define FAKE_NO_LIMIT 0xFFFFFFFFFFFFFFFFull

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
    /* Device memory charged to each cgroup (by its key's hash), as r615+ drivers
     * charge every allocation to the cgroup of the process that makes it. */
    uint32_t ncgroups;
    uint64_t cg_ino[FAKE_MAX_CGROUPS];
    uint64_t cg_used[FAKE_MAX_CGROUPS];
    /* Under $FAKE_MPS: when each process's queued work ends, and the most processes that had
     * work on the card at once. */
    uint64_t proc_until[FAKE_MAX_PROCS];
    uint32_t mps_concurrent_max;
    /* Time each process had work on the card, waiting behind others' included (from a
     * launch to its kernel's end), and when its queued work ends. */
    uint64_t pending_ns[FAKE_MAX_PROCS];
    uint64_t pending_until[FAKE_MAX_PROCS];
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

/* Per-cgroup limits (the fake NVML's nvmlDeviceSetMemoryLimits_v1 writes them, the fake
 * libcuda holds allocations to them): files in $FAKE_NVML_LIMITS (else the directory compiled
 * in as FAKE_NVML_LIMITS_DIR) holding "UUID SOFT HARD", one per way a process can name its
 * cgroup: "path-" and its path under the cgroup v2 root with '/' as '%' (a process in the host's
 * cgroup namespace), "ino-" and its directory's inode (one in a namespace of its own, whose
 * /sys/fs/cgroup is its cgroup). Without a directory, no cgroup has limits. */
static inline const char *fake_limits_dir(void) {
    const char *d = getenv("FAKE_NVML_LIMITS");
#ifdef FAKE_NVML_LIMITS_DIR
    if (!d) d = FAKE_NVML_LIMITS_DIR;
#endif
    return d;
}

static inline void fake_path_key(const char *rel, char *out, size_t n) {
    snprintf(out, n, "path-%s", rel);
    for (char *c = out + 5; *c; c++)
        if (*c == '/') *c = '%';
}

/* The key the calling process's cgroup has ("" when it has no cgroup v2 entry). */
static inline const char *fake_own_cgroup(void) {
    static char key[600];
    if (key[0]) return key;
    FILE *f = fopen("/proc/self/cgroup", "r");
    if (!f) return key;
    char line[512];
    while (fgets(line, sizeof line, f)) {
        if (strncmp(line, "0::", 3)) continue;
        line[strcspn(line, "\n")] = 0;
        struct stat st;
        if (!strcmp(line + 3, "/")) {
            if (stat("/sys/fs/cgroup", &st) == 0) snprintf(key, sizeof key, "ino-%llu", (unsigned long long)st.st_ino);
        } else {
            fake_path_key(line + 3, key, sizeof key);
        }
    }
    fclose(f);
    return key;
}

/* The hard limit on the cgroup keyed `key` (FAKE_NO_LIMIT when it has none). */
static inline uint64_t fake_cgroup_hard(const char *key) {
    const char *d = fake_limits_dir();
    if (!d || !key[0]) return FAKE_NO_LIMIT;
    char path[1200], uuid[96];
    snprintf(path, sizeof path, "%s/%s", d, key);
    FILE *f = fopen(path, "r");
    if (!f) return FAKE_NO_LIMIT;
    unsigned long long soft = 0, hard = FAKE_NO_LIMIT;
    if (fscanf(f, "%95s %llu %llu", uuid, &soft, &hard) != 3) hard = FAKE_NO_LIMIT;
    fclose(f);
    return hard;
}

static inline uint64_t fake_hash(const char *s) {
    uint64_t h = 1469598103934665603ull;
    for (; *s; s++) h = (h ^ (unsigned char)*s) * 1099511628211ull;
    return h;
}

/* The slot of the cgroup keyed `key` (registered on first use; the lock held); -1 when none. */
static inline int fake_cgroup(struct fake_gpu *g, const char *key) {
    if (!key[0]) return -1;
    uint64_t ino = fake_hash(key);
    for (uint32_t i = 0; i < g->ncgroups; i++)
        if (g->cg_ino[i] == ino) return (int)i;
    if (g->ncgroups == FAKE_MAX_CGROUPS) return -1;
    g->cg_ino[g->ncgroups] = ino;
    return (int)g->ncgroups++;
}
