"""A DNS server for tests: answers A queries for any name with the addresses it is given now.

gRPC's DNS resolver takes the server to ask from the target (`dns://127.0.0.1:PORT/name:port`), so a
test can move a name's replicas without touching /etc/hosts or a real DNS zone."""

from __future__ import annotations

import socket
import threading

import dns.message
import dns.rcode
import dns.rdatatype
import dns.rrset


class StubDNS:
    def __init__(self, addresses: list[str]) -> None:
        self.addresses = list(addresses)
        self.num_queries = 0
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self._thread = threading.Thread(target=self._serve, name="stub-dns", daemon=True)
        self._thread.start()

    def target(self, name: str, port: int) -> str:
        """The gRPC target resolving `name` through this server."""
        return f"dns://127.0.0.1:{self.port}/{name}:{port}"

    def _serve(self) -> None:
        while True:
            try:
                data, peer = self._sock.recvfrom(4096)
            except OSError:  # closed
                return
            query = dns.message.from_wire(data)
            reply = dns.message.make_response(query)
            question = query.question[0]
            if question.rdtype == dns.rdatatype.A and self.addresses:
                self.num_queries += 1
                reply.answer.append(dns.rrset.from_text_list(question.name, 1, "IN", "A", list(self.addresses)))
            elif question.rdtype != dns.rdatatype.AAAA:
                reply.set_rcode(dns.rcode.NXDOMAIN)
            try:
                self._sock.sendto(reply.to_wire(), peer)
            except OSError:  # closed while answering
                return

    def close(self) -> None:
        self._sock.close()
