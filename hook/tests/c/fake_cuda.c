/* A fake libcuda.so.1 for tessera-cuda-hook's tests: the entry points the hook touches, with
 * the real ones' signatures, over the fake GPU of fake_gpu.h. Memory: $FAKE_GPU_MEMORY_MIB
 * (default 16384). A kernel costs $FAKE_NS_PER_BLOCK ns per block of its grid (default 1000)
 * on the shared timeline; launches block while more than 2 ms of work is queued, as a full
 * GPU queue does. Context creation takes $FAKE_CTX_DELAY_MS. cuGetProcAddress answers with the versioned functions, as the driver does. */
#include <string.h>
#include "fake_gpu.h"

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef void *H;
#define OK 0
#define OOM 2
#define INVALID 1
#define NOT_FOUND 500

#define MAXA 65536
static __thread int dummy_tls;
static struct { uint64_t id, size; int cg; } allocs[MAXA];
static uint32_t nallocs;
static uint32_t alloc_lock;

static uint64_t total(void) {
    const char *m = getenv("FAKE_GPU_MEMORY_MIB");
    return (uint64_t)(m ? atoll(m) : 16384) << 20;
}

static CUresult take(uint64_t size, uint64_t *id) {
    struct fake_gpu *g = fake_gpu();
    const char *key = fake_own_cgroup();
    uint64_t hard = fake_cgroup_hard(key);
    fake_lock(g);
    if (!g->memory_total) g->memory_total = total();
    if (!g->next_ptr) g->next_ptr = 0x7f0000000000ull;
    int cg = fake_cgroup(g, key);
    if (g->memory_used + size > g->memory_total || (cg >= 0 && hard != FAKE_NO_LIMIT && g->cg_used[cg] + size > hard)) {
        fake_unlock(g);
        return OOM;
    }
    g->memory_used += size;
    if (cg >= 0) g->cg_used[cg] += size;
    fake_own_mem(g, (int64_t)size);
    *id = g->next_ptr;
    g->next_ptr += (size + 511) / 512 * 512 + 512;
    fake_unlock(g);
    while (__atomic_exchange_n(&alloc_lock, 1, __ATOMIC_ACQUIRE)) {}
    if (nallocs < MAXA) { allocs[nallocs].id = *id; allocs[nallocs].size = size; allocs[nallocs].cg = cg; nallocs++; }
    __atomic_store_n(&alloc_lock, 0, __ATOMIC_RELEASE);
    return OK;
}

static CUresult give(uint64_t id) {
    uint64_t size = 0;
    int found = 0, cg = -1;
    while (__atomic_exchange_n(&alloc_lock, 1, __ATOMIC_ACQUIRE)) {}
    for (uint32_t i = 0; i < nallocs; i++)
        if (allocs[i].id == id) { size = allocs[i].size; cg = allocs[i].cg; allocs[i] = allocs[--nallocs]; found = 1; break; }
    __atomic_store_n(&alloc_lock, 0, __ATOMIC_RELEASE);
    if (!found) return 1; /* CUDA_ERROR_INVALID_VALUE */
    struct fake_gpu *g = fake_gpu();
    fake_lock(g);
    g->memory_used -= size;
    if (cg >= 0) g->cg_used[cg] -= size;
    fake_own_mem(g, -(int64_t)size);
    fake_unlock(g);
    return OK;
}

/* How far ahead of the card a process may queue work before a launch blocks. */
static uint64_t queue_ns(void) {
    const char *q = getenv("FAKE_QUEUE_MS");
    return (uint64_t)(q ? atoll(q) : 2) * 1000000ull;
}

static void wait_until(uint64_t until, uint64_t ahead) {
    for (;;) {
        uint64_t t = fake_now_ns();
        if (until <= t + ahead) break;
        uint64_t d = until - ahead - t;
        struct timespec ts = {(time_t)(d / 1000000000ull), (long)(d % 1000000000ull)};
        nanosleep(&ts, NULL);
    }
}

/* Under $FAKE_MPS: the calling process's kernel runs on its own timeline, at its share of the
 * SMs. */
static void run_mps(struct fake_gpu *g, uint64_t cost) {
    const char *pc = getenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE");
    uint64_t pct = pc ? (uint64_t)atoll(pc) : 100;
    if (pct < 1 || pct > 100) pct = 100;
    fake_lock(g);
    uint64_t now = fake_now_ns();
    int p = fake_proc(g, (uint32_t)getpid());
    if (p < 0) { fake_unlock(g); return; }
    uint64_t start = g->proc_until[p] > now ? g->proc_until[p] : now;
    g->proc_until[p] = start + cost * 100 / pct;
    g->busy_ns[p] += cost;
    g->busy_total_ns += cost;
    g->launches++;
    uint32_t on = 0;
    for (uint32_t i = 0; i < g->nprocs; i++)
        if (g->proc_until[i] > now) on++;
    if (on > g->mps_concurrent_max) g->mps_concurrent_max = on;
    uint64_t until = g->proc_until[p];
    fake_unlock(g);
    wait_until(until, queue_ns());
}

/* Waits for the calling process's queued work: on its own timeline under $FAKE_MPS, else
 * until its last kernel on the card's ends. */
static void drained(void) {
    struct fake_gpu *g = fake_gpu();
    fake_lock(g);
    int p = -1;
    for (uint32_t i = 0; i < g->nprocs; i++)
        if (g->pids[i] == (uint32_t)getpid()) p = (int)i;
    uint64_t until = p < 0 ? 0 : getenv("FAKE_MPS") ? g->proc_until[p] : g->pending_until[p];
    fake_unlock(g);
    wait_until(until, 0);
}

static void run(uint64_t blocks) {
    const char *c = getenv("FAKE_NS_PER_BLOCK");
    uint64_t cost = blocks * (uint64_t)(c ? atoll(c) : 1000);
    struct fake_gpu *g = fake_gpu();
    if (getenv("FAKE_MPS")) { run_mps(g, cost); return; }
    fake_lock(g);
    uint64_t now = fake_now_ns();
    uint64_t start = g->busy_until_ns > now ? g->busy_until_ns : now;
    g->busy_until_ns = start + cost;
    int p = fake_proc(g, (uint32_t)getpid());
    if (p >= 0) {
        g->busy_ns[p] += cost;
        g->pending_ns[p] += g->busy_until_ns - (g->pending_until[p] > now ? g->pending_until[p] : now);
        g->pending_until[p] = g->busy_until_ns;
    }
    g->busy_total_ns += cost;
    g->launches++;
    uint64_t until = g->busy_until_ns;
    fake_unlock(g);
    wait_until(until, queue_ns());
}

static uint64_t grid(unsigned x, unsigned y, unsigned z) {
    return (uint64_t)(x ? x : 1) * (y ? y : 1) * (z ? z : 1);
}

CUresult cuInit(unsigned flags) { (void)flags; (void)dummy_tls; return OK; }
CUresult cuDeviceGet(int *dev, int ordinal) { *dev = ordinal; return OK; }
/* Creating a context takes $FAKE_CTX_DELAY_MS (default 0); the process shows on the card
 * half way through, as on a real GPU. A process's first context holds $FAKE_CTX_MIB of device
 * memory (default 0; a CUDA 13 context held 527 MiB of an H100 with driver 580). */
static void ctx_delay(void) {
    const char *d = getenv("FAKE_CTX_DELAY_MS");
    long ms = d ? atol(d) / 2 : 0;
    struct timespec t = {ms / 1000, (ms % 1000) * 1000000L};
    if (ms > 0) nanosleep(&t, NULL);
}
static CUresult ctx(H *c) {
    struct fake_gpu *g = fake_gpu();
    ctx_delay();
    static int has_context;
    const char *m = getenv("FAKE_CTX_MIB");
    uint64_t bytes = has_context ? 0 : (uint64_t)(m ? atoll(m) : 0) << 20;
    fake_lock(g);
    fake_proc(g, (uint32_t)getpid());
    g->memory_used += bytes;
    fake_own_mem(g, (int64_t)bytes);
    fake_unlock(g);
    has_context = 1;
    ctx_delay();
    *c = (H)0x1;
    return OK;
}
static int primary_active;
/* Retaining the primary context once it is active only counts a reference, as the driver's does. */
CUresult cuDevicePrimaryCtxRetain(H *c, int dev) {
    (void)dev;
    if (primary_active) { *c = (H)0x1; return OK; }
    primary_active = 1;
    return ctx(c);
}
CUresult cuDevicePrimaryCtxGetState(int dev, unsigned *flags, int *active) { (void)dev; *flags = 0; *active = primary_active; return OK; }
CUresult cuDevicePrimaryCtxRelease_v2(int dev) { (void)dev; return OK; }
CUresult cuDeviceGetCount(int *n) { *n = 1; return OK; }
CUresult cuCtxPushCurrent_v2(H c) { (void)c; return OK; }
CUresult cuCtxPopCurrent_v2(H *c) { *c = (H)0x1; return OK; }
CUresult cuCtxDestroy_v2(H c) { (void)c; return OK; }
CUresult cuCtxCreate_v2(H *c, unsigned flags, int dev) { (void)flags; (void)dev; return ctx(c); }
CUresult cuCtxCreate_v3(H *c, void *params, int n, unsigned flags, int dev) { (void)params; (void)n; (void)flags; (void)dev; return ctx(c); }

CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n) { uint64_t id; CUresult r = take(n, &id); if (r == OK) *p = id; return r; }
/* The pre-3.2 entry point: 32-bit pointers, another signature (the hook must not wrap it). */
CUresult cuMemAlloc(unsigned *p, unsigned n) { uint64_t id; CUresult r = take(n, &id); if (r == OK) *p = (unsigned)id; return r; }
CUresult cuMemAllocManaged(CUdeviceptr *p, size_t n, unsigned f) { (void)f; return cuMemAlloc_v2(p, n); }

/* Stream-ordered pools, per process as the driver keeps them: a pool holds (reserves) device
 * memory; what is freed into it stays held until a synchronisation gives back what is above
 * the pool's release threshold (default 0), or cuMemPoolTrimTo. Pool 1 is device 0's default
 * pool; cuMemPoolCreate makes others. */
#define MAX_POOLS 8
#define POOL_PTR 0x7e0000000000ull
static struct { uint64_t reserved, used, threshold; int live; } pools[MAX_POOLS + 1] = {[1] = {0, 0, 0, 1}};
static uint64_t current_pool = 1;
static struct { uint64_t id, size, pool; } pool_allocs[MAXA];
static uint32_t npool_allocs;
static uint64_t next_pool_ptr = POOL_PTR;
static int pool_ok(H p) { uint64_t i = (uint64_t)p; return i >= 1 && i <= MAX_POOLS && pools[i].live; }
static void pool_trim(uint64_t i, uint64_t keep) {
    uint64_t target = pools[i].used > keep ? pools[i].used : keep;
    if (pools[i].reserved <= target) return;
    struct fake_gpu *g = fake_gpu();
    fake_lock(g);
    g->memory_used -= pools[i].reserved - target;
    fake_own_mem(g, -(int64_t)(pools[i].reserved - target));
    fake_unlock(g);
    pools[i].reserved = target;
}
static CUresult pool_alloc(CUdeviceptr *p, uint64_t n, uint64_t i) {
    uint64_t spare = pools[i].reserved - pools[i].used;
    if (n > spare) {
        struct fake_gpu *g = fake_gpu();
        fake_lock(g);
        if (!g->memory_total) g->memory_total = total();
        if (g->memory_used + (n - spare) > g->memory_total) { fake_unlock(g); return OOM; }
        g->memory_used += n - spare;
        fake_own_mem(g, (int64_t)(n - spare));
        fake_unlock(g);
        pools[i].reserved += n - spare;
    }
    pools[i].used += n;
    *p = next_pool_ptr;
    next_pool_ptr += (n + 511) / 512 * 512 + 512;
    if (npool_allocs < MAXA) { pool_allocs[npool_allocs].id = *p; pool_allocs[npool_allocs].size = n; pool_allocs[npool_allocs].pool = i; npool_allocs++; }
    return OK;
}
static CUresult pool_free(CUdeviceptr p) {
    for (uint32_t k = 0; k < npool_allocs; k++)
        if (pool_allocs[k].id == p) {
            pools[pool_allocs[k].pool].used -= pool_allocs[k].size;
            pool_allocs[k] = pool_allocs[--npool_allocs];
            return OK;
        }
    return INVALID;
}
static void synchronized(void) {
    for (uint64_t i = 1; i <= MAX_POOLS; i++)
        if (pools[i].live) pool_trim(i, pools[i].threshold);
}
CUresult cuCtxGetDevice(int *dev) { *dev = 0; return OK; }
CUresult cuDeviceGetDefaultMemPool(H *pool, int dev) { (void)dev; *pool = (H)1; return OK; }
CUresult cuDeviceGetMemPool(H *pool, int dev) { (void)dev; *pool = (H)current_pool; return OK; }
CUresult cuDeviceSetMemPool(int dev, H pool) { (void)dev; if (!pool_ok(pool)) return INVALID; current_pool = (uint64_t)pool; return OK; }
CUresult cuMemPoolCreate(H *pool, const void *props) {
    (void)props;
    for (uint64_t i = 2; i <= MAX_POOLS; i++)
        if (!pools[i].live) { pools[i].live = 1; pools[i].reserved = pools[i].used = pools[i].threshold = 0; *pool = (H)i; return OK; }
    return OOM;
}
CUresult cuMemPoolDestroy(H pool) {
    if (!pool_ok(pool) || (uint64_t)pool == 1) return INVALID;
    pool_trim((uint64_t)pool, 0);
    pools[(uint64_t)pool].live = 0;
    if (current_pool == (uint64_t)pool) current_pool = 1;
    return OK;
}
CUresult cuMemPoolTrimTo(H pool, size_t keep) { if (!pool_ok(pool)) return INVALID; pool_trim((uint64_t)pool, keep); return OK; }
/* Attributes as CUmemPool_attribute numbers them: 4 release threshold, 5 reserved now, 7 used now. */
CUresult cuMemPoolSetAttribute(H pool, int attr, void *v) {
    if (!pool_ok(pool) || attr != 4) return INVALID;
    pools[(uint64_t)pool].threshold = *(uint64_t *)v;
    return OK;
}
CUresult cuMemPoolGetAttribute(H pool, int attr, void *v) {
    if (!pool_ok(pool)) return INVALID;
    uint64_t i = (uint64_t)pool;
    switch (attr) {
    case 4: *(uint64_t *)v = pools[i].threshold; return OK;
    case 5: *(uint64_t *)v = pools[i].reserved; return OK;
    case 7: *(uint64_t *)v = pools[i].used; return OK;
    default: return INVALID;
    }
}
CUresult cuStreamSynchronize(H s) { (void)s; drained(); synchronized(); return OK; }
CUresult cuStreamSynchronize_ptsz(H s) { return cuStreamSynchronize(s); }
/* Stream capture, as far as the hook's tests need it: as on the real driver, synchronising
 * the context while a stream captures fails and invalidates the capture. */
static int capturing, capture_broken;
CUresult cuStreamBeginCapture_v2(H s, int mode) { (void)s; (void)mode; capturing = 1; capture_broken = 0; return OK; }
CUresult cuStreamEndCapture(H s, H *g) {
    (void)s;
    *g = (H)0x1;
    int broken = capture_broken;
    capturing = capture_broken = 0;
    return broken ? 901 /* CUDA_ERROR_STREAM_CAPTURE_INVALIDATED */ : OK;
}
CUresult cuStreamBeginCapture_v2_ptsz(H s, int mode) { return cuStreamBeginCapture_v2(s, mode); }
CUresult cuStreamEndCapture_ptsz(H s, H *g) { return cuStreamEndCapture(s, g); }
CUresult cuCtxSynchronize(void) {
    if (capturing) { capture_broken = 1; return 900; /* CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED */ }
    drained(); synchronized(); return OK;
}
CUresult cuMemAllocAsync(CUdeviceptr *p, size_t n, H s) { (void)s; return pool_alloc(p, n, current_pool); }
CUresult cuMemAllocAsync_ptsz(CUdeviceptr *p, size_t n, H s) { return cuMemAllocAsync(p, n, s); }
CUresult cuMemAllocFromPoolAsync(CUdeviceptr *p, size_t n, H pool, H s) {
    (void)s;
    if (!pool_ok(pool)) return INVALID;
    return pool_alloc(p, n, (uint64_t)pool);
}
CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *p, size_t n, H pool, H s) { return cuMemAllocFromPoolAsync(p, n, pool, s); }
CUresult cuMemAllocPitch_v2(CUdeviceptr *p, size_t *pitch, size_t w, size_t h, unsigned e) {
    (void)e;
    *pitch = (w + 511) / 512 * 512;
    return cuMemAlloc_v2(p, *pitch * h);
}
/* Stream-ordered memory may be freed either way; it goes back to its pool. */
CUresult cuMemFree_v2(CUdeviceptr p) { return (p & ~0xffffffffffull) == POOL_PTR ? pool_free(p) : give(p); }
CUresult cuMemFreeAsync(CUdeviceptr p, H s) { (void)s; return cuMemFree_v2(p); }
CUresult cuMemFreeAsync_ptsz(CUdeviceptr p, H s) { (void)s; return cuMemFree_v2(p); }
/* Virtual memory management as the driver does it: a handle's memory stays while any mapping of
 * it exists, even after cuMemRelease (ggml-cuda releases right after mapping), and goes with the
 * last unmap. Handles and mappings are the process's own. */
#define MAX_VMM 256
static struct { uint64_t h; int maps; int released; } vmm_handles[MAX_VMM];
static struct { uint64_t va, size, h; } vmm_maps[MAX_VMM];
static int vmm_slot(uint64_t h) {
    for (int i = 0; i < MAX_VMM; i++) if (vmm_handles[i].h == h) return i;
    return -1;
}
CUresult cuMemCreate(unsigned long long *h, size_t n, const void *prop, unsigned long long f) {
    (void)prop; (void)f;
    uint64_t id; CUresult r = take(n, &id);
    if (r != OK) return r;
    int i = vmm_slot(0);
    if (i < 0) { give(id); return OOM; }
    vmm_handles[i].h = id; vmm_handles[i].maps = 0; vmm_handles[i].released = 0;
    *h = id;
    return OK;
}
CUresult cuMemRelease(unsigned long long h) {
    int i = vmm_slot(h);
    if (i < 0) return give(h);
    if (vmm_handles[i].maps > 0) { vmm_handles[i].released = 1; return OK; }
    vmm_handles[i].h = 0;
    return give(h);
}
CUresult cuMemMap(CUdeviceptr va, size_t size, size_t offset, unsigned long long h, unsigned long long f) {
    (void)offset; (void)f;
    int i = vmm_slot(h), m = -1;
    for (int j = 0; j < MAX_VMM && m < 0; j++) if (!vmm_maps[j].size) m = j;
    if (i < 0 || m < 0 || vmm_handles[i].released) return INVALID;
    vmm_maps[m].va = va; vmm_maps[m].size = size; vmm_maps[m].h = h;
    vmm_handles[i].maps++;
    return OK;
}
CUresult cuMemUnmap(CUdeviceptr va, size_t size) {
    for (int j = 0; j < MAX_VMM; j++) {
        if (!vmm_maps[j].size || vmm_maps[j].va < va || vmm_maps[j].va >= va + size) continue;
        int i = vmm_slot(vmm_maps[j].h);
        vmm_maps[j].size = 0;
        if (i >= 0 && --vmm_handles[i].maps == 0 && vmm_handles[i].released) {
            give(vmm_handles[i].h);
            vmm_handles[i].h = 0;
        }
    }
    return OK;
}
struct desc { size_t w, h; unsigned fmt, ch; };
struct desc3 { size_t w, h, d; unsigned fmt, ch, flags; };
static uint64_t fmt_bytes(unsigned f) { return (f == 1 || f == 8) ? 1 : (f == 2 || f == 9 || f == 0x10) ? 2 : 4; }
CUresult cuArrayCreate_v2(H *a, const struct desc *d) {
    uint64_t id; CUresult r = take(d->w * (d->h ? d->h : 1) * d->ch * fmt_bytes(d->fmt), &id);
    if (r == OK) *a = (H)id; return r;
}
CUresult cuArray3DCreate_v2(H *a, const struct desc3 *d) {
    uint64_t id; CUresult r = take(d->w * (d->h ? d->h : 1) * (d->d ? d->d : 1) * d->ch * fmt_bytes(d->fmt), &id);
    if (r == OK) *a = (H)id; return r;
}
CUresult cuArrayDestroy(H a) { return give((uint64_t)a); }
CUresult cuMemGetInfo_v2(size_t *fr, size_t *to) {
    struct fake_gpu *g = fake_gpu();
    fake_lock(g);
    if (!g->memory_total) g->memory_total = total();
    *to = g->memory_total;
    *fr = g->memory_total - g->memory_used;
    fake_unlock(g);
    return OK;
}
CUresult cuDeviceTotalMem_v2(size_t *b, int dev) { (void)dev; *b = total(); return OK; }

CUresult cuLaunchKernel(H f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned sh, H s, void **p, void **e) {
    (void)f; (void)bx; (void)by; (void)bz; (void)sh; (void)s; (void)p; (void)e;
    run(grid(gx, gy, gz));
    return OK;
}
CUresult cuLaunchKernel_ptsz(H f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                             unsigned sh, H s, void **p, void **e) {
    return cuLaunchKernel(f, gx, gy, gz, bx, by, bz, sh, s, p, e);
}
struct launch_config { unsigned gx, gy, gz, bx, by, bz, sh; H s; void *attrs; unsigned n; };
CUresult cuLaunchKernelEx(const struct launch_config *c, H f, void **p, void **e) {
    (void)f; (void)p; (void)e;
    run(grid(c->gx, c->gy, c->gz));
    return OK;
}
CUresult cuLaunchKernelEx_ptsz(const struct launch_config *c, H f, void **p, void **e) { return cuLaunchKernelEx(c, f, p, e); }
CUresult cuLaunchCooperativeKernel(H f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                                   unsigned bz, unsigned sh, H s, void **p) {
    return cuLaunchKernel(f, gx, gy, gz, bx, by, bz, sh, s, p, NULL);
}
CUresult cuLaunchCooperativeKernel_ptsz(H f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                                        unsigned bz, unsigned sh, H s, void **p) {
    return cuLaunchKernel(f, gx, gy, gz, bx, by, bz, sh, s, p, NULL);
}
CUresult cuGraphLaunch(H g, H s) { (void)g; (void)s; run(1024); return OK; }
CUresult cuGraphLaunch_ptsz(H g, H s) { return cuGraphLaunch(g, s); }

CUresult cuGetProcAddress(const char *sym, void **pfn, int version, unsigned long long flags);
CUresult cuGetProcAddress_v2(const char *sym, void **pfn, int version, unsigned long long flags, int *status);

#define PTDS 2ull
static void *lookup(const char *s, int version, unsigned long long flags) {
    int ptds = (flags & PTDS) != 0;
#define E(name, fn) if (!strcmp(s, name)) return (void *)(fn);
#define P(name, fn, fnp) if (!strcmp(s, name)) return ptds ? (void *)(fnp) : (void *)(fn);
    if (!strcmp(s, "cuMemAlloc")) return version >= 3020 ? (void *)cuMemAlloc_v2 : (void *)cuMemAlloc;
    E("cuInit", cuInit) E("cuDeviceGet", cuDeviceGet)
    E("cuDevicePrimaryCtxRetain", cuDevicePrimaryCtxRetain)
    /* As the real 535 libcuda answers: cuCtxCreate_v3 from 11040 on. */
    if (!strcmp(s, "cuCtxCreate")) return version >= 11040 ? (void *)cuCtxCreate_v3 : (void *)cuCtxCreate_v2;
    E("cuMemAllocManaged", cuMemAllocManaged) E("cuMemAllocPitch", cuMemAllocPitch_v2)
    P("cuMemAllocAsync", cuMemAllocAsync, cuMemAllocAsync_ptsz)
    P("cuMemAllocFromPoolAsync", cuMemAllocFromPoolAsync, cuMemAllocFromPoolAsync_ptsz)
    E("cuMemFree", cuMemFree_v2) P("cuMemFreeAsync", cuMemFreeAsync, cuMemFreeAsync_ptsz)
    E("cuCtxGetDevice", cuCtxGetDevice) E("cuDeviceGetDefaultMemPool", cuDeviceGetDefaultMemPool)
    E("cuDeviceGetMemPool", cuDeviceGetMemPool) E("cuDeviceSetMemPool", cuDeviceSetMemPool)
    E("cuMemPoolCreate", cuMemPoolCreate) E("cuMemPoolDestroy", cuMemPoolDestroy) E("cuMemPoolTrimTo", cuMemPoolTrimTo)
    E("cuMemPoolSetAttribute", cuMemPoolSetAttribute) E("cuMemPoolGetAttribute", cuMemPoolGetAttribute)
    P("cuStreamSynchronize", cuStreamSynchronize, cuStreamSynchronize_ptsz) E("cuCtxSynchronize", cuCtxSynchronize)
    if (!strcmp(s, "cuStreamBeginCapture"))
        return version < 10010 ? NULL : ptds ? (void *)cuStreamBeginCapture_v2_ptsz : (void *)cuStreamBeginCapture_v2;
    P("cuStreamEndCapture", cuStreamEndCapture, cuStreamEndCapture_ptsz)
    E("cuMemCreate", cuMemCreate) E("cuMemRelease", cuMemRelease)
    E("cuMemMap", cuMemMap) E("cuMemUnmap", cuMemUnmap)
    E("cuArrayCreate", cuArrayCreate_v2) E("cuArray3DCreate", cuArray3DCreate_v2) E("cuArrayDestroy", cuArrayDestroy)
    E("cuMemGetInfo", cuMemGetInfo_v2) E("cuDeviceTotalMem", cuDeviceTotalMem_v2)
    P("cuLaunchKernel", cuLaunchKernel, cuLaunchKernel_ptsz) P("cuLaunchKernelEx", cuLaunchKernelEx, cuLaunchKernelEx_ptsz)
    P("cuLaunchCooperativeKernel", cuLaunchCooperativeKernel, cuLaunchCooperativeKernel_ptsz)
    P("cuGraphLaunch", cuGraphLaunch, cuGraphLaunch_ptsz)
    if (!strcmp(s, "cuGetProcAddress")) return version >= 12000 ? (void *)cuGetProcAddress_v2 : (void *)cuGetProcAddress;
    return NULL;
}
CUresult cuGetProcAddress(const char *sym, void **pfn, int version, unsigned long long flags) {
    *pfn = lookup(sym, version, flags);
    return *pfn ? OK : NOT_FOUND;
}
CUresult cuGetProcAddress_v2(const char *sym, void **pfn, int version, unsigned long long flags, int *status) {
    *pfn = lookup(sym, version, flags);
    if (status) *status = *pfn ? 0 : 1;
    return *pfn ? OK : NOT_FOUND;
}
