"""Sans-IO credit-based flow control: subpartitions, input channels, pools, messages, wire codec.

Nothing in this package opens a socket, starts a thread or reads a clock.
"""
