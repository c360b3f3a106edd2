"""Shared by the scripts' own checks: a file without the script's table is an error that names it."""
import os


def expect_refusal(run, tmp, content, message):
    """run(path) on a file holding only `content` must fail with `message` and the file's name."""
    path = os.path.join(tmp, "empty.csv")
    with open(path, "w") as f:
        f.write(content)
    r = run(path)
    assert r.returncode != 0 and message in r.stderr and "empty.csv" in r.stderr, (r.returncode, r.stderr)
