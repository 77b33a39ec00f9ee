"""Write the class-data-sharing archive the tests' Spark JVMs start from: ``python tests/jvm_class_archive.py OUT``.

A Spark JVM spends about half of what it costs to start (some 4 of 8 s of CPU here, to its first job) loading,
parsing and verifying the classes of Spark's jars. The JVM can write the classes an application loaded to an
archive when it exits (``-XX:ArchiveClassesAtExit``) and later JVMs map that archive instead
(``-XX:SharedArchiveFile``; JDK 13 and later). ``make test`` writes one archive per virtual environment (its
PySpark jars, this machine's JDK) from a session like the tests' one, running the kinds of work the tests run,
and ``spark_helpers.TEST_JVM_OPTIONS`` hands it to every Spark JVM the tests start: their own sessions, the
applications of their own (``local-cluster`` executors included) and the notebooks' kernel. A JVM whose jars
no longer match the archive runs without it, as before.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ARCHIVE_WRITE_TIMEOUT_S = 180


def main(out: Path) -> None:
    tests = Path(__file__).resolve().parent
    sys.path.insert(0, str(tests))
    from conftest import MASTER, session_settings
    from spark_helpers import TEST_JVM_OPTIONS_WITHOUT_ARCHIVE

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F

    import spark_credit_shuffle as scs

    written = out.with_name(out.name + ".tmp")  # renamed to ``out`` once the JVM has written all of it
    written.unlink(missing_ok=True)
    quiet = TEST_JVM_OPTIONS_WITHOUT_ARCHIVE.replace("-Xlog:all=warning:stderr", "-Xlog:all=error:stderr")
    builder = SparkSession.builder.master(MASTER).appName("class archive")
    conf = {
        **session_settings(0),
        # the classes it cannot archive (generated ones, signed jars) are no news: errors only
        "spark.driver.extraJavaOptions": f"{quiet} -XX:ArchiveClassesAtExit={written}",
    }
    for key, value in conf.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    df = spark.range(0, 2000, 1, 3).select("id", (F.col("id") % 7).alias("k"), F.col("id").cast("string").alias("s"))
    for mode in ("blocking", "pipelined"):
        ex = scs.exchange(df, scs.key_by("k"), 2, mode)
        assert ex.df.groupBy("k").count().count() == 7
        ex.metrics().toPandas()
    df.repartition(2).toPandas()
    proc = spark.sparkContext._gateway.proc  # type: ignore[attr-defined]
    spark.stop()
    proc.stdin.close()  # the JVM exits when its Python closes this pipe, and writes the archive as it exits
    proc.wait(timeout=ARCHIVE_WRITE_TIMEOUT_S)
    if not written.is_file():
        raise SystemExit(f"the JVM exited with code {proc.returncode} and wrote no class archive to {written}")
    written.replace(out)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python tests/jvm_class_archive.py OUT")
    main(Path(sys.argv[1]).resolve())
