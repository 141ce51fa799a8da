"""The store server: gRPC service, validation, metrics and process lifecycle."""
