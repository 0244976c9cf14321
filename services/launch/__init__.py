"""The local launcher (`python -m services.launch`)."""

import os

# The launcher forks its children while its own gRPC server (LauncherControl) runs. gRPC's fork
# handlers serve a child that goes on using gRPC, which an exec'd child never does, and they
# print a line on the console per fork: off in the launcher, and children get the user's
# setting back (child_env).
INHERITED_FORK_SUPPORT = os.environ.get("GRPC_ENABLE_FORK_SUPPORT")
os.environ["GRPC_ENABLE_FORK_SUPPORT"] = "false"
