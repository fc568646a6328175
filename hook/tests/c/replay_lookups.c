/* Replays driver lookups as the CUDA runtime makes them: lines "symbol version flags" on stdin,
 * each asked of cuGetProcAddress as the runtime reaches it (dlopen libcuda.so.1, dlsym
 * cuGetProcAddress, then cuGetProcAddress looked up through itself). Prints, per line,
 * "symbol version flags library answer" (the answer's own symbol name, or "-"). The real
 * libcuda answers without a GPU: no cuInit is needed. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

typedef int (*gpa_t)(const char *, void **, int, unsigned long long);

int main(void) {
    void *h = dlopen("libcuda.so.1", RTLD_NOW);
    if (!h) { printf("error=%s\n", dlerror()); return 3; }
    gpa_t gpa = (gpa_t)dlsym(h, "cuGetProcAddress");
    if (!gpa) { printf("error=no cuGetProcAddress\n"); return 3; }
    void *self = NULL;
    if (gpa("cuGetProcAddress", &self, 11030, 0) == 0 && self) gpa = (gpa_t)self;
    char sym[256];
    int version;
    unsigned long long flags;
    while (scanf("%255s %d %llu", sym, &version, &flags) == 3) {
        void *p = NULL;
        int r = gpa(sym, &p, version, flags);
        Dl_info i = {0};
        const char *lib = "-", *name = "-";
        if (r == 0 && p && dladdr(p, &i)) {
            if (i.dli_fname) lib = strrchr(i.dli_fname, '/') ? strrchr(i.dli_fname, '/') + 1 : i.dli_fname;
            if (i.dli_sname) name = i.dli_sname;
        }
        printf("%s %d %llu %s %s\n", sym, version, flags, lib, name);
    }
    return 0;
}
