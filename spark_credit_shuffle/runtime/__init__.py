"""Spark glue: the blocking and pipelined exchanges as Spark stages."""
