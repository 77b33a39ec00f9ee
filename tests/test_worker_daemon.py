"""``spark_credit_shuffle_daemon``: Python workers import the installed PySpark, not the copy in its zip."""

from __future__ import annotations

import zipfile

import pytest

import spark_credit_shuffle_daemon as daemon


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


@pytest.mark.spark
def test_workers_of_the_tests_session_import_the_installed_pyspark(spark):
    """The tests' session runs its workers from this daemon (``tests/conftest.py``): PySpark comes from the
    installed package, the zips are off the path, and the rows come back exact."""

    def where(rows):
        import sys as worker_sys

        import pyspark

        yield pyspark.__file__, [p for p in worker_sys.path if p.endswith((".zip", ".jar"))], sum(rows)

    [(pyspark_file, archives, total)] = spark.sparkContext.parallelize(range(100), 1).mapPartitions(where).collect()
    import pyspark

    assert pyspark_file == pyspark.__file__ and total == sum(range(100))
    assert not [a for a in archives if "pyspark" in a], archives
