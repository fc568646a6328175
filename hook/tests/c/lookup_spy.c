/* Records the driver lookups a CUDA runtime makes, to stderr: "lookup SYMBOL VERSION FLAGS LIB"
 * per cuGetProcAddress call (LIB: the library the answer lies in). Preload it first, on a
 * machine with a GPU (the runtime looks its functions up only once cuInit succeeded):
 *
 *   cc -shared -fPIC -o lookup_spy.so lookup_spy.c -ldl
 *   LD_PRELOAD=$PWD/lookup_spy.so ./program-linked-with-libcudart 2> lookups.txt
 *
 * With LOOKUP_SPY_NEXT naming the hook library and both preloaded (the spy first), the answers
 * are the hook's. It wraps the runtime's dlsym lookups of cuGetProcAddress(_v2) and every
 * cuGetProcAddress the driver hands back. Not built by the tests: it made
 * tests/fixtures/cudart-*-lookups.txt (a cuGetProcAddress asked for at 12000 or later is
 * cuGetProcAddress_v2, as the real driver answers). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int (*gpa2_t)(const char *, void **, int, unsigned long long, int *);
typedef int (*gpa_t)(const char *, void **, int, unsigned long long);
static gpa2_t next2;
static gpa_t next1;

static void note(const char *s, void *p, int v, unsigned long long f) {
    Dl_info i = {0};
    const char *lib = p && dladdr(p, &i) && i.dli_fname ? strrchr(i.dli_fname, '/') + 1 : "null";
    fprintf(stderr, "lookup %s %d %llu %s\n", s, v, f, lib);
}

static int gpa1(const char *s, void **p, int v, unsigned long long f);
static int gpa2(const char *s, void **p, int v, unsigned long long f, int *st);

/* A cuGetProcAddress handed back is wrapped too (the runtime looks it up through itself). */
static void follow(const char *s, void **p, int v) {
    if (strcmp(s, "cuGetProcAddress")) return;
    if (v >= 12000) { next2 = (gpa2_t)*p; *p = (void *)gpa2; }
    else { next1 = (gpa_t)*p; *p = (void *)gpa1; }
}

static int gpa2(const char *s, void **p, int v, unsigned long long f, int *st) {
    int r = next2(s, p, v, f, st);
    note(s, r ? NULL : *p, v, f);
    if (!r) follow(s, p, v);
    return r;
}

static int gpa1(const char *s, void **p, int v, unsigned long long f) {
    int r = next1(s, p, v, f);
    note(s, r ? NULL : *p, v, f);
    if (!r) follow(s, p, v);
    return r;
}

void *dlsym(void *h, const char *s) {
    static void *(*real)(void *, const char *), *(*next)(void *, const char *);
    if (!real) real = dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
    if (!real) real = dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5");
    if (!next) {
        const char *n = getenv("LOOKUP_SPY_NEXT");
        void *lib = n ? dlopen(n, RTLD_NOW | RTLD_NOLOAD) : NULL;
        next = lib ? real(lib, "dlsym") : real;
    }
    void *p = next(h, s);
    if (p && !strcmp(s, "cuGetProcAddress_v2")) { next2 = (gpa2_t)p; return (void *)gpa2; }
    if (p && !strcmp(s, "cuGetProcAddress")) { next1 = (gpa_t)p; return (void *)gpa1; }
    return p;
}
