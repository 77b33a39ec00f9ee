"""``spark_credit_shuffle.worker.daemon``: Python workers import the installed PySpark, not the copy in its zip, and
their collection after each task walks only what the task left."""

from __future__ import annotations

import gc
import weakref
import zipfile

import pytest

import spark_credit_shuffle.worker.daemon as daemon


def _site(tmp_path, with_package: bool):
    site = tmp_path / "site-packages"
    lib = site / "pyspark" / "python" / "lib"
    lib.mkdir(parents=True)
    if with_package:
        (site / "pyspark" / "__init__.py").write_text("")
    archive = lib / "pyspark.zip"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("pyspark/__init__.py", "")
    jar = site / "pyspark" / "jars" / "spark-core.jar"
    jar.parent.mkdir()
    jar.write_bytes(archive.read_bytes())
    return site, archive, jar


def test_the_zips_of_an_installed_pyspark_are_its_duplicates(tmp_path):
    site, archive, jar = _site(tmp_path, with_package=True)
    other = tmp_path / "elsewhere.zip"
    other.write_bytes(archive.read_bytes())
    path = [str(archive), str(jar), str(other), str(site)]
    assert daemon.spark_path_duplicates(path) == [str(archive), str(jar)]


def test_a_pyspark_only_in_its_zip_keeps_the_zip(tmp_path):
    """A cluster's ``$SPARK_HOME`` PySpark with no installed package: the zip is the only copy."""
    site, archive, jar = _site(tmp_path, with_package=False)
    assert daemon.spark_path_duplicates([str(archive), str(jar), str(site)]) == []


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def _cycle() -> weakref.ref:
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def _frozen(obj: object) -> bool:
    """``obj`` is tracked by the collector but in none of its generations: in the permanent one (``gc.freeze``)."""
    return gc.is_tracked(obj) and all(o is not obj for o in gc.get_objects())


def test_the_collection_after_a_task_reclaims_its_cycles_and_every_nth_the_older_ones():
    collector = daemon.TaskEndCollector(full_every=3)
    gc.disable()  # only the collector's collections, as between a worker's tasks
    try:
        survivor = _Node()  # alive at the first task's end and after
        collector.collect()
        assert gc.get_freeze_count() > 0 and _frozen(survivor)  # the survivors are out of the generations
        older = _Node()  # alive at the next task's end: frozen with the survivors
        older.other = older
        collector.collect()  # the end of task 2
        # the earlier survivors stay frozen and the new one joins them (counting the frozen objects would not
        # say so: reference counting frees frozen objects as any others)
        assert _frozen(survivor) and _frozen(older)
        older_ref = weakref.ref(older)
        del older  # now a cycle among frozen objects
        task_garbage = _cycle()  # garbage the next task leaves in a cycle
        collector.collect()  # the third collection: unfreezes and walks everything
        assert task_garbage() is None and older_ref() is None
        older = _Node()
        older.other = older
        collector.collect()
        older_ref = weakref.ref(older)
        del older
        task_garbage = _cycle()
        collector.collect()  # the fifth: this task's garbage goes, the older cycle waits for the sixth
        assert task_garbage() is None and older_ref() is not None
        collector.collect()
        assert older_ref() is None
        assert collector.isenabled() is False  # the rest is the gc module's
    finally:
        gc.unfreeze()
        gc.enable()


@pytest.mark.spark
def test_workers_of_the_tests_session_import_the_installed_pyspark(spark):
    """The tests' session runs its workers from this daemon (``tests/conftest.py``): PySpark comes from the
    installed package, the zips are off the path, and the rows come back exact."""

    def where(rows):
        import gc as worker_gc
        import sys as worker_sys

        import pyspark

        collector = type(worker_sys.modules["pyspark.daemon"].gc).__name__
        archives = [p for p in worker_sys.path if p.endswith((".zip", ".jar"))]
        yield pyspark.__file__, archives, collector, worker_gc.get_freeze_count(), sum(rows)

    [(pyspark_file, archives, collector, frozen, total)] = (
        spark.sparkContext.parallelize(range(100), 1).mapPartitions(where).collect()
    )
    import pyspark

    assert pyspark_file == pyspark.__file__ and total == sum(range(100))
    assert not [a for a in archives if "pyspark" in a], archives
    assert collector == "TaskEndCollector" and frozen > 0  # what the daemon imported is frozen before the fork


def test_an_exchange_task_sets_up_the_task_end_collection_in_pyspark_s_own_daemon():
    """A worker forked by PySpark's own daemon (``python -m pyspark.daemon``, whose loop calls its module's
    ``gc.collect()`` after each task): the exchange's first task there puts the TaskEndCollector in its place,
    once; a worker of any other origin is left alone."""
    import pyspark.daemon as pyspark_daemon

    from spark_credit_shuffle.runtime.resources import freeze_worker_heap

    assert pyspark_daemon.gc is gc
    try:
        assert freeze_worker_heap(False, daemon=pyspark_daemon) is False  # freeze_worker_heap=False: left alone
        assert pyspark_daemon.gc is gc
        assert freeze_worker_heap(daemon=pyspark_daemon) is True
        assert isinstance(pyspark_daemon.gc, daemon.TaskEndCollector)
        assert freeze_worker_heap(daemon=pyspark_daemon) is False  # set up already: an earlier task, or that daemon
    finally:
        pyspark_daemon.gc = gc
    assert freeze_worker_heap() is False  # this process's __main__ is not PySpark's daemon
    assert freeze_worker_heap(daemon=daemon) is False
