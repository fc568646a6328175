/* A fake libnvidia-ml.so.1 over the fake GPU of fake_gpu.h: the compute processes are those
 * that created a context, named by the pid each registered (its own getpid(): for clients in one
 * pid namespace, the pid the real 580 driver answers a query made in that namespace); a
 * process's SM utilization is its busy share of a sampling window. Only what tessera-cuda-hook
 * calls. */
#include <string.h>
#include "fake_gpu.h"

typedef int nvmlReturn_t;
struct sample { unsigned pid; unsigned long long ts; unsigned sm, mem, enc, dec; };
struct pinfo { unsigned pid; unsigned long long mem; unsigned gi, ci; };
struct util { unsigned gpu, memory; };

/* Per-process samples as the real driver keeps them (H100, driver 580): one per process every
 * $FAKE_NVML_SAMPLE_MS (default 200) ms, the busy share of that window, each process on a
 * phase of its own (the second process half a period after the first, and so on), so that a
 * query can find a newer sample of another process and none yet of its own; a query with no
 * sample newer than its `since` answers NOT_FOUND. Under $FAKE_MPS every sample goes to the MPS
 * server (a pid of no client, FAKE_MPS_SERVER_PID) and none to its clients, as on that H100.
 * Under $FAKE_NVML_TIMESLICED a process's figure is the time it had work on the card, its waits
 * behind other processes' work included, as that H100 counts it under time-slicing (two busy
 * processes held at 50% readings each got 0.18x-0.33x of the card). */
#define FAKE_MPS_SERVER_PID 4194304u
static uint64_t window_ns[FAKE_MAX_PROCS + 1], last_busy[FAKE_MAX_PROCS], card_ns, card_total;
/* The newest sample of each process (the server's last), `ts` 0 before the first. */
static struct sample samples[FAKE_MAX_PROCS + 1];

/* Whether the window of sampled entity `i` (a process, or the server at FAKE_MAX_PROCS) has
 * ended; `*dt` its length. Each entity's first window starts `i` half-periods back in phase. */
static int window_ended(unsigned i, uint64_t now, uint64_t period, uint64_t *dt) {
    if (!window_ns[i]) {
        window_ns[i] = now - (uint64_t)(i % 2) * (period / 2);
        return 0;
    }
    if (now - window_ns[i] < period) return 0;
    *dt = now - window_ns[i];
    window_ns[i] = now;
    return 1;
}

static void sample(struct fake_gpu *g) {
    const char *p = getenv("FAKE_NVML_SAMPLE_MS");
    uint64_t period = (uint64_t)(p ? atoll(p) : 200) * 1000000ull;
    uint64_t now = fake_now_ns(), dt = 0;
    if (getenv("FAKE_MPS")) {
        /* One window for the server: the busy time of every client. */
        uint64_t busy = 0;
        int first = !window_ns[FAKE_MAX_PROCS];
        int ended = window_ended(FAKE_MAX_PROCS, now, period, &dt);
        if (!first && !ended) return;
        for (unsigned i = 0; i < g->nprocs; i++) {
            busy += g->busy_ns[i] - last_busy[i];
            last_busy[i] = g->busy_ns[i];
        }
        if (!ended) return;
        struct sample *s = &samples[FAKE_MAX_PROCS];
        memset(s, 0, sizeof *s);
        s->pid = FAKE_MPS_SERVER_PID;
        s->ts = now / 1000;
        s->sm = (unsigned)(busy * 100 / dt > 100 ? 100 : busy * 100 / dt);
        return;
    }
    const uint64_t *used = getenv("FAKE_NVML_TIMESLICED") ? g->pending_ns : g->busy_ns;
    for (unsigned i = 0; i < g->nprocs; i++) {
        int first = !window_ns[i];
        if (!window_ended(i, now, period, &dt)) {
            if (first) last_busy[i] = used[i];
            continue;
        }
        uint64_t busy = used[i] - last_busy[i];
        last_busy[i] = used[i];
        struct sample *s = &samples[i];
        s->pid = g->pids[i];
        s->ts = now / 1000;
        s->sm = (unsigned)(busy * 100 / dt);
        if (s->sm > 100) s->sm = 100;
        s->mem = s->enc = s->dec = 0;
    }
}

nvmlReturn_t nvmlInit_v2(void) { return 0; }
nvmlReturn_t nvmlInit(void) { return 0; }
nvmlReturn_t nvmlShutdown(void) { return 0; }
nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, void **dev) {
    if (strncmp(uuid, "GPU-", 4)) return 2; /* INVALID_ARGUMENT */
    /* The handle is the card's UUID (kept for the life of the process). */
    *dev = strdup(uuid);
    return *dev ? 0 : 20;
}
nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(void *dev, unsigned *n, struct pinfo *out) {
    (void)dev;
    struct fake_gpu *g = fake_gpu();
    fake_lock(g);
    unsigned have = g->nprocs;
    if (*n < have) { *n = have; fake_unlock(g); return 7; }
    for (unsigned i = 0; i < have; i++) {
        memset(&out[i], 0, sizeof out[i]);
        out[i].pid = g->pids[i];
        out[i].mem = g->proc_mem[i];
    }
    *n = have;
    fake_unlock(g);
    return 0;
}
nvmlReturn_t nvmlDeviceGetProcessUtilization(void *dev, struct sample *out, unsigned *n, unsigned long long since) {
    (void)dev;
    struct fake_gpu *g = fake_gpu();
    fake_lock(g);
    sample(g);
    unsigned fresh = 0;
    for (unsigned i = 0; i <= FAKE_MAX_PROCS; i++)
        if (samples[i].ts && samples[i].ts > since) fresh++;
    if (!fresh) { fake_unlock(g); return 6; } /* NOT_FOUND */
    if (!out || *n < fresh) { *n = fresh; fake_unlock(g); return 7; }
    unsigned k = 0;
    for (unsigned i = 0; i <= FAKE_MAX_PROCS; i++)
        if (samples[i].ts && samples[i].ts > since) out[k++] = samples[i];
    fake_unlock(g);
    *n = k;
    return 0;
}
nvmlReturn_t nvmlDeviceGetUtilizationRates(void *dev, struct util *u) {
    (void)dev;
    struct fake_gpu *g = fake_gpu();
    fake_lock(g);
    uint64_t now = fake_now_ns();
    uint64_t dt = card_ns ? now - card_ns : 0;
    u->gpu = dt ? (unsigned)((g->busy_total_ns - card_total) * 100 / dt) : 0;
    if (u->gpu > 100) u->gpu = 100;
    card_total = g->busy_total_ns;
    card_ns = now;
    fake_unlock(g);
    u->memory = 0;
    return 0;
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *out, unsigned len) {
    const char *v = getenv("FAKE_NVML_DRIVER");
#ifdef FAKE_NVML_R580
    if (!v) v = "580.159.04";
#else
    if (!v) v = "615.29.01";
#endif
    if (strlen(v) + 1 > len) return 7; /* INSUFFICIENT_SIZE */
    memcpy(out, v, strlen(v) + 1);
    return 0;
}

const char *nvmlErrorString(nvmlReturn_t rc) {
    switch (rc) {
    case 0: return "Success";
    case 2: return "Invalid Argument";
    case 3: return "Not Supported";
    case 6: return "Not Found";
    case 17: return "Operating System Error";
    default: return "Unknown Error";
    }
}

#ifndef FAKE_NVML_R580
/* Per-cgroup memory limits as nvml.h (CUDA 13.4+) documents them: the cgroup is its full sysfs
 * path and must exist (OPERATING_SYSTEM otherwise); soft above hard, or a hard limit above the
 * card's memory, is INVALID_ARGUMENT; soft 0 with hard NVML_DEVICE_MEMORY_LIMIT_MAX clears
 * them; reading a cgroup without limits is NOT_FOUND. Kept in fake_gpu.h's limits directory,
 * where the fake libcuda holds allocations to them. currentUsed is not known here (0). */
typedef struct { const char *ns; unsigned long long soft, hard; } set_limits_t;
typedef struct { const char *ns; unsigned long long soft, hard, used; } get_limits_t;

/* The cgroup v2 root in this process's mount namespace. */
static int cgroup2_root(char *out, size_t n) {
    FILE *f = fopen("/proc/self/mountinfo", "r");
    char line[1024];
    int found = 0;
    while (f && !found && fgets(line, sizeof line, f)) {
        char *sep = strstr(line, " - cgroup2 ");
        if (!sep) continue;
        char mnt[512];
        if (sscanf(line, "%*s %*s %*s %*s %511s", mnt) == 1) { snprintf(out, n, "%s", mnt); found = 1; }
    }
    if (f) fclose(f);
    return found;
}

/* The two files of cgroup `ns` (see fake_gpu.h); OPERATING_SYSTEM when it is no directory. */
static int limits_files(const char *ns, char by_ino[1200], char by_path[1200]) {
    struct stat st;
    const char *d = fake_limits_dir();
    if (!ns || stat(ns, &st) != 0 || !S_ISDIR(st.st_mode)) return 17;
    if (!d) return 3;
    snprintf(by_ino, 1200, "%s/ino-%llu", d, (unsigned long long)st.st_ino);
    char root[512], key[700];
    size_t len;
    by_path[0] = 0;
    if (cgroup2_root(root, sizeof root) && (len = strlen(root)) && !strncmp(ns, root, len) && ns[len] == '/') {
        fake_path_key(ns + len, key, sizeof key);
        snprintf(by_path, 1200, "%s/%s", d, key);
    }
    return 0;
}

static int write_limits(const char *path, const char *uuid, unsigned long long soft, unsigned long long hard) {
    char tmp[1300];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "w");
    if (!f) return 17;
    fprintf(f, "%s %llu %llu\n", uuid, soft, hard);
    fclose(f);
    return rename(tmp, path) ? 17 : 0;
}

nvmlReturn_t nvmlDeviceSetMemoryLimits_v1(void *dev, set_limits_t *l) {
    char by_ino[1200], by_path[1200];
    if (!dev || !l) return 2;
    int rc = limits_files(l->ns, by_ino, by_path);
    if (rc) return rc;
    const char *m = getenv("FAKE_GPU_MEMORY_MIB");
    unsigned long long total = (unsigned long long)(m ? atoll(m) : 16384) << 20;
    if (l->soft > l->hard || (l->hard != FAKE_NO_LIMIT && l->hard > total) || l->soft > total) return 2;
    if (l->soft == 0 && l->hard == FAKE_NO_LIMIT) {
        unlink(by_ino);
        if (by_path[0]) unlink(by_path);
        return 0;
    }
    if (by_path[0] && (rc = write_limits(by_path, dev, l->soft, l->hard))) return rc;
    return write_limits(by_ino, dev, l->soft, l->hard);
}

nvmlReturn_t nvmlDeviceGetMemoryLimits_v1(void *dev, get_limits_t *l) {
    char by_ino[1200], by_path[1200], uuid[96];
    if (!dev || !l) return 2;
    int rc = limits_files(l->ns, by_ino, by_path);
    if (rc) return rc;
    FILE *f = fopen(by_ino, "r");
    if (!f) return 6;
    int n = fscanf(f, "%95s %llu %llu", uuid, &l->soft, &l->hard);
    fclose(f);
    l->used = 0;
    return n == 3 ? 0 : 999;
}
#endif
