"""`python -m rlt_engine.http_api …`: the HTTP server process that rlt-serve starts."""

import sys

from rlt_engine.http_api.process import child_main

sys.exit(child_main())
