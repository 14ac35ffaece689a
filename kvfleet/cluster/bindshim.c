/* The process node's per-pod address (issue #43): an LD_PRELOAD shim for bind().
 *
 * Where it sits: kvfleet/cluster/processes.py compiles this once per source hash into
 * <state dir>/bindshim.so; every container process runs with LD_PRELOAD=<that> and
 * KVFLEET_POD_IP=<its pod's loopback address> (127.1.0.2, 127.1.0.3, ...). A server that binds
 * "all addresses", as servers in containers do, then listens on its own pod's address only, so two
 * pods may serve the same port on one machine.
 *
 *   AF_INET,  INADDR_ANY (0.0.0.0) -> KVFLEET_POD_IP, same port.
 *   AF_INET6, in6addr_any (::) with IPV6_V6ONLY off (a dual-stack socket) -> ::ffff:KVFLEET_POD_IP:
 *             the socket then takes IPv4 connections to the pod's address only.
 *   AF_INET6, :: with IPV6_V6ONLY on -> left alone: IPv6 has no per-pod loopback address here, so
 *             two pods' IPv6-only listeners on one port collide.
 *   Anything else (a specific address, 127.0.0.1, AF_UNIX) -> left alone; so is every bind when
 *   KVFLEET_POD_IP is unset or not an IPv4 address.
 *
 * A process whose parent is the kubelet ($KVFLEET_KUBELET_PID: a container's first process) also
 * asks the kernel for SIGKILL should the kubelet die without stopping it (PR_SET_PDEATHSIG), so a
 * killed kubelet leaves no orphan behind; its own children are not so tied (they may daemonise).
 *
 * Only dynamically linked programs calling libc's bind() are covered (Python, most C/C++ servers);
 * a statically linked Go binary makes the system call itself and binds all addresses.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <unistd.h>

__attribute__((constructor)) static void tie_to_kubelet(void) {
    const char *kubelet = getenv("KVFLEET_KUBELET_PID");
    if (kubelet != NULL && atol(kubelet) > 1 && getppid() == (pid_t)atol(kubelet))
        prctl(PR_SET_PDEATHSIG, SIGKILL);
}

typedef int (*bind_fn)(int, const struct sockaddr *, socklen_t);

static bind_fn next_bind(void) {
    static bind_fn real;
    if (real == NULL)
        real = (bind_fn)dlsym(RTLD_NEXT, "bind");
    return real;
}

static int pod_address(struct in_addr *out) {
    const char *ip = getenv("KVFLEET_POD_IP");
    return ip != NULL && inet_pton(AF_INET, ip, out) == 1;
}

static int dual_stack(int fd) {
    int v6only = 1;
    socklen_t len = sizeof v6only;
    return getsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &v6only, &len) == 0 && v6only == 0;
}

int bind(int fd, const struct sockaddr *addr, socklen_t len) {
    struct in_addr pod;
    if (addr != NULL && addr->sa_family == AF_INET && len >= (socklen_t)sizeof(struct sockaddr_in)) {
        struct sockaddr_in mine;
        memcpy(&mine, addr, sizeof mine);
        if (mine.sin_addr.s_addr == htonl(INADDR_ANY) && pod_address(&pod)) {
            mine.sin_addr = pod;
            return next_bind()(fd, (const struct sockaddr *)&mine, sizeof mine);
        }
    } else if (addr != NULL && addr->sa_family == AF_INET6 && len >= (socklen_t)sizeof(struct sockaddr_in6)) {
        struct sockaddr_in6 mine;
        memcpy(&mine, addr, sizeof mine);
        if (IN6_IS_ADDR_UNSPECIFIED(&mine.sin6_addr) && pod_address(&pod) && dual_stack(fd)) {
            memset(&mine.sin6_addr, 0, sizeof mine.sin6_addr);
            mine.sin6_addr.s6_addr[10] = 0xff;
            mine.sin6_addr.s6_addr[11] = 0xff;
            memcpy(&mine.sin6_addr.s6_addr[12], &pod, sizeof pod);
            return next_bind()(fd, (const struct sockaddr *)&mine, sizeof mine);
        }
    }
    return next_bind()(fd, addr, len);
}
