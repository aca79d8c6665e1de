"""Per-run data keys for content kept sealed at rest, held in a key store apart from the
platform's database, so that destroying a run's key makes every copy of its sealed content
unreadable: the live rows, dead row versions, WAL, dumps and backups alike (crypto-shredding,
docs/history.md "Sealed content").

    vault.store     the key store: its own database (CONTENT_KEYS_DATABASE_URL), one row a run
    vault.sealing   seal / unseal with the run's data key (AES-256-GCM), wrapped by the tenant's key;
                    shred a run's key
"""
