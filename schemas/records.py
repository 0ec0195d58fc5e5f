"""Where the records that outlive the bus go by default: the recorder's database and the request log's
archive, under the local stack's data dir ($TOKENBUS_HOME/data, as `tokenbus up` uses it) unless
TB_DATABASE and TB_ARCHIVE (or the commands' --database and --archive) say otherwise."""
import os
from pathlib import Path

DATABASE_ENV = "TB_DATABASE"             # postgresql://… or sqlite:///path
ARCHIVE_ENV = "TB_ARCHIVE"               # a directory or an fsspec URL


def data_dir() -> Path:
    return Path(os.environ.get("TOKENBUS_HOME") or Path.home() / ".cache" / "tokenbus") / "data"


def sqlite_url(data: Path) -> str:
    """The embedded database of a stack whose data dir is `data`."""
    return f"sqlite:///{Path(data).absolute() / 'records.db'}"


def archive_dir(data: Path) -> str:
    return str(Path(data).absolute() / "archive")


def default_database() -> str:
    return os.environ.get(DATABASE_ENV) or sqlite_url(data_dir())


def default_archive() -> str:
    return os.environ.get(ARCHIVE_ENV) or archive_dir(data_dir())
