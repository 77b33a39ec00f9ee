"""Transports that move protocol messages: in memory (tests, simulation) and TCP."""
