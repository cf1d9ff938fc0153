"""wqwire: what the broker (``wqbroker``) and the client (``wqclient``) share, and neither owns.

- :mod:`wqwire.pb`: the gRPC/protobuf stubs generated from ``proto/wqwire/pb/broker.proto`` (the
  protobuf package ``wq.v1``), and the ``.proto`` itself, for clients in other languages;
- :mod:`wqwire.defaults`: the wire contract's defaults, caps, paths and names, as both sides must
  read them (a claim's default wait, the longest lease, the default queue ...);
- :mod:`wqwire.scan`: reading JSON while keeping chosen members as their exact text (a payload is
  carried byte for byte, never decoded and re-encoded);
- :mod:`wqwire.flags`: the command-line conventions every wq command follows (Go-style flags,
  ``WQ_*`` environment variables, ``-log-format``).

Both packages import this one; it imports neither (import-linter checks it in ``make lint``). It
loads no gRPC unless :mod:`wqwire.pb` is imported.
"""
