"""What both ends agree on, importing neither end: the wire records (``protocol``), block
geometry (``layout``), sample identity, share checksums (``integrity``, ``block_digest``),
authentication and the handshake, framed control connections, and the transport
(``transport`` the protocol, ``nixl_transport`` the only module that imports nixl)."""
