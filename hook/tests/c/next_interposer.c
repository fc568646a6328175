/* An interposer in the usual style: it defines puts and reaches the real one with
 * dlsym(RTLD_NEXT, "puts"), which must mean "the next puts after this library". */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
int puts(const char *s) {
    int (*next)(const char *) = (int (*)(const char *))dlsym(RTLD_NEXT, "puts");
    if (!next || next == puts) {
        fprintf(stderr, "dlsym(RTLD_NEXT, \"puts\") gave %s\n", next ? "this library's own puts" : "nothing");
        return -1;
    }
    fputs("interposed: ", stdout);
    return next(s);
}
