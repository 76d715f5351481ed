DROP FUNCTION outbox_archive_published;
DROP FUNCTION outbox_published_partitions;
DROP TABLE outbox_published;
