"""What runs in Spark's Python worker processes outside an exchange's tasks: the worker daemon
(:mod:`.daemon`), started by PySpark before any task, and the collection it sets up after each task.

Nothing here imports the rest of the package, pyarrow, pandas or pyspark when imported: the daemon imports
this package before it forks its workers, and a module that starts threads when imported would make the fork
unsafe.
"""
