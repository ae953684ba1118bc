-- Runs once, when the postgres-data volume is first initialised: MLflow's basic-auth app keeps its users and
-- permissions in a database of their own, so runs and accounts are dumped, restored and upgraded separately.
CREATE DATABASE mlflow_auth;
