// Stands in for <sys/single_threaded.h> (glibc 2.32 and later) when the
// shim is compiled against glibc 2.28 (scripts/build-wheel.sh: zig c++,
// target x86_64-linux-gnu.2.28, GCC's libstdc++ headers), and only then.
//
// GCC 11+'s libstdc++ includes it where it exists and then reads
// `__libc_single_threaded` to skip atomic reference counts in a process
// with one thread. Zig's glibc headers have the file but refuse it below
// 2.32, and glibc 2.28 has no such variable. Here it is a constant 0,
// "maybe several threads": libstdc++ then always takes the atomic path,
// which is what it did before glibc 2.32 and is correct everywhere.
#ifndef NIXL_SYS_COMPAT_SINGLE_THREADED_H
#define NIXL_SYS_COMPAT_SINGLE_THREADED_H
static const char __libc_single_threaded = 0;
#endif
