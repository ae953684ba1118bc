#!/bin/sh
# Prepares what `mlflow server --app-name basic-auth` reads at start, then runs the container's command.
# - The auth config: users and permissions live in PostgreSQL ($MLFLOW_AUTH_DATABASE_URI). The admin account
#   comes from MLFLOW_AUTH_ADMIN_USERNAME / MLFLOW_AUTH_ADMIN_PASSWORD (read by MLflow, created at the first
#   start only), so no password is written here except inside the database URI, in a 0600 file. Verified
#   credentials are cached for MLFLOW_AUTH_CACHE_SECONDS (60): each check is a deliberately slow password hash,
#   and a training job sends a request per step and file.
# - The artifact bucket on the S3 store (MinIO), created when missing.
set -eu
: "${MLFLOW_AUTH_DATABASE_URI:?is not set (docker-compose.yml builds it from POSTGRES_PASSWORD in .env)}"
: "${MLFLOW_ARTIFACTS_BUCKET:?is not set (docker-compose.yml sets it from .env)}"

umask 077
MLFLOW_AUTH_CONFIG_PATH="${HOME}/basic_auth.ini"
cat > "${MLFLOW_AUTH_CONFIG_PATH}" <<CONFIG
[mlflow]
default_permission = ${MLFLOW_DEFAULT_PERMISSION:-READ}
database_uri = ${MLFLOW_AUTH_DATABASE_URI}
authorization_function = mlflow.server.auth:authenticate_request_basic_auth
auth_cache_ttl_seconds = ${MLFLOW_AUTH_CACHE_SECONDS:-60}
CONFIG
export MLFLOW_AUTH_CONFIG_PATH

python - <<'PYTHON'
import os

import boto3
from botocore.exceptions import ClientError

bucket = os.environ["MLFLOW_ARTIFACTS_BUCKET"]
s3 = boto3.client("s3", endpoint_url=os.environ.get("MLFLOW_S3_ENDPOINT_URL"))
try:
    s3.head_bucket(Bucket=bucket)
except ClientError:
    s3.create_bucket(Bucket=bucket)
    print(f"mlflow-entrypoint: created artifact bucket {bucket}", flush=True)
PYTHON

exec "$@"
