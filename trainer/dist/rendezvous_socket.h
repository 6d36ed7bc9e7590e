// The rendezvous port as a socket handed from `nnstrain launch` to rank 0, so
// that nobody can take the port between the launcher's choice and rank 0's
// TCPStore (which takes the socket over: TCPStoreOptions::masterListenFd).
// No LibTorch here.
#pragma once

#include <optional>
#include <utility>

namespace nnstrain::dist {

// The launcher passes the socket to rank 0 as this descriptor, named by this variable.
constexpr const char* kRendezvousFdVar = "NNSTRAIN_RENDEZVOUS_FD";
constexpr int kRendezvousFd = 3;

// A listening socket on `port` (0: one the kernel picks) on every local address,
// as a TCPStore server binds it: IPv6 with IPv4 mapped where there is IPv6, else
// IPv4. Returns {fd (close-on-exec), port}, or {-1, 0} with errno set
// (EADDRINUSE: someone listens on the port).
std::pair<int, int> listen_on(int port);

// Whether `fd` is a socket listening on `port`.
bool listening_on(int fd, int port);

// In rank 0: the socket the launcher passed (NNSTRAIN_RENDEZVOUS_FD), when it is
// one listening on `port`; the first call only, since the store that takes it
// over closes it. Made close-on-exec, so what rank 0 starts never inherits it.
std::optional<int> take_rendezvous_socket(int port);

}  // namespace nnstrain::dist
