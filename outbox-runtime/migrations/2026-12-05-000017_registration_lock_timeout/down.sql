ALTER FUNCTION outbox_register_topology(TEXT, TEXT, TEXT) RESET lock_timeout;
