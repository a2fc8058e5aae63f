"""How every pdspec process logs: key=value lines, quiet by default, except that servers report
their own start-up and failures at INFO (third-party libraries stay at WARNING). The CLI sets it
up for its process; launchers hand the level on to the router and workers they start."""

import logging

_OWN_LOGGERS = ("engine", "router", "prefill_worker", "decode_worker", "kvtransfer", "serving", "deploy", "proto")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def configure_logging(level: str | None, server: bool) -> None:
    """`level`: DEBUG, INFO, WARNING or ERROR for every logger; None: the defaults above."""
    logging.basicConfig(level=(level or "WARNING").upper(),
                        format='ts=%(asctime)s level=%(levelname)s logger=%(name)s pid=%(process)d msg="%(message)s"')
    if level is None and server:
        for name in _OWN_LOGGERS:
            logging.getLogger(name).setLevel(logging.INFO)
