DROP FUNCTION IF EXISTS outbox_register_topology(TEXT, TEXT, TEXT);
DROP TABLE IF EXISTS outbox_topologies;
