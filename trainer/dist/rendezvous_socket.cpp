#include "trainer/dist/rendezvous_socket.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>

namespace nnstrain::dist {

namespace {

int port_of(const sockaddr_storage& a) {
  if (a.ss_family == AF_INET6) return ntohs(reinterpret_cast<const sockaddr_in6*>(&a)->sin6_port);
  if (a.ss_family == AF_INET) return ntohs(reinterpret_cast<const sockaddr_in*>(&a)->sin_port);
  return -1;
}

}  // namespace

std::pair<int, int> listen_on(int port) {
  for (int family : {AF_INET6, AF_INET}) {
    int s = socket(family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (s < 0) {
      if (family == AF_INET6) continue;  // no IPv6 here
      return {-1, 0};
    }
    int one = 1, zero = 0;
    // As TCPStore: connections of a past run in TIME_WAIT are no conflict.
    setsockopt(s, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    sockaddr_storage a{};
    socklen_t len;
    if (family == AF_INET6) {
      setsockopt(s, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);
      auto* a6 = reinterpret_cast<sockaddr_in6*>(&a);
      a6->sin6_family = AF_INET6;
      a6->sin6_addr = in6addr_any;
      a6->sin6_port = htons(static_cast<uint16_t>(port));
      len = sizeof *a6;
    } else {
      auto* a4 = reinterpret_cast<sockaddr_in*>(&a);
      a4->sin_family = AF_INET;
      a4->sin_addr.s_addr = htonl(INADDR_ANY);
      a4->sin_port = htons(static_cast<uint16_t>(port));
      len = sizeof *a4;
    }
    if (bind(s, reinterpret_cast<sockaddr*>(&a), len) == 0 && listen(s, SOMAXCONN) == 0 &&
        getsockname(s, reinterpret_cast<sockaddr*>(&a), &len) == 0)
      return {s, port_of(a)};
    const int err = errno;
    close(s);
    errno = err;
    // A port in use is in use for IPv4 too; IPv6 failing otherwise (disabled) gets the IPv4 try.
    if (err == EADDRINUSE || family == AF_INET) return {-1, 0};
  }
  return {-1, 0};
}

bool listening_on(int fd, int port) {
  sockaddr_storage a{};
  socklen_t len = sizeof a;
  int listening = 0;
  socklen_t llen = sizeof listening;
  return getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0 &&
         getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &llen) == 0 && listening && port_of(a) == port;
}

std::optional<int> take_rendezvous_socket(int port) {
  static std::atomic<bool> taken{false};
  const char* v = std::getenv(kRendezvousFdVar);
  if (!v || taken.exchange(true)) return std::nullopt;
  char* end = nullptr;
  const long fd = std::strtol(v, &end, 10);
  if (end == v || *end || fd < 0 || fd > 1 << 20) return std::nullopt;
  // Only a listening socket on this very port: a variable left over from
  // elsewhere must not hand the store some other descriptor.
  if (!listening_on(static_cast<int>(fd), port)) return std::nullopt;
  fcntl(static_cast<int>(fd), F_SETFD, FD_CLOEXEC);
  return static_cast<int>(fd);
}

}  // namespace nnstrain::dist
