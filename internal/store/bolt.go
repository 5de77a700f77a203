package store

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	bolt "go.etcd.io/bbolt"
	bolterrors "go.etcd.io/bbolt/errors"
)

// FileName is the database's name inside the data directory.
const FileName = "state.db"

var (
	bucketInstances  = []byte("instances")
	bucketMigrations = []byte("migrations")
	bucketLaunched   = []byte("launched")
)

// Bolt is the embedded store, one Host's (bbolt, in its data directory).
// It is safe for concurrent use.
type Bolt struct {
	db *bolt.DB
}

// OpenBolt opens (creating) the store in dir. A second Host on the same
// data directory is refused, not blocked: the database is locked.
func OpenBolt(dir string) (*Bolt, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("data directory %s: %w", dir, err)
	}
	path := filepath.Join(dir, FileName)
	db, err := bolt.Open(path, 0o600, &bolt.Options{Timeout: 2 * time.Second})
	if err != nil {
		if errors.Is(err, bolterrors.ErrTimeout) {
			return nil, fmt.Errorf("the state in %s is held by another vhi host (pick another --data-dir)", path)
		}
		return nil, fmt.Errorf("open the Host's state %s: %w", path, err)
	}
	err = db.Update(func(tx *bolt.Tx) error {
		for _, b := range [][]byte{bucketInstances, bucketMigrations, bucketLaunched} {
			if _, err := tx.CreateBucketIfNotExists(b); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		db.Close()
		return nil, fmt.Errorf("initialise the Host's state: %w", err)
	}
	return &Bolt{db: db}, nil
}

// Close closes the database.
func (s *Bolt) Close() error { return s.db.Close() }

// Lost implements Store: nothing else can take an embedded store.
func (s *Bolt) Lost() <-chan struct{} { return nil }

func put(db *bolt.DB, bucket []byte, key string, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	return db.Update(func(tx *bolt.Tx) error { return tx.Bucket(bucket).Put([]byte(key), b) })
}

func del(db *bolt.DB, bucket []byte, key string) error {
	return db.Update(func(tx *bolt.Tx) error { return tx.Bucket(bucket).Delete([]byte(key)) })
}

// PutInstance writes an instance's record.
func (s *Bolt) PutInstance(i Instance) error { return put(s.db, bucketInstances, i.ID, i) }

// DeleteInstance forgets an instance.
func (s *Bolt) DeleteInstance(id string) error { return del(s.db, bucketInstances, id) }

// Instances returns every instance record.
func (s *Bolt) Instances() ([]Instance, error) { return all[Instance](s.db, bucketInstances) }

// all decodes every record of bucket.
func all[T any](db *bolt.DB, bucket []byte) ([]T, error) {
	var out []T
	err := db.View(func(tx *bolt.Tx) error {
		return tx.Bucket(bucket).ForEach(func(_, v []byte) error {
			var r T
			if err := json.Unmarshal(v, &r); err != nil {
				return err
			}
			out = append(out, r)
			return nil
		})
	})
	return out, err
}

// PutMigration writes a migration's record (its status JSON) under id.
func (s *Bolt) PutMigration(id string, record json.RawMessage) error {
	return s.db.Update(func(tx *bolt.Tx) error { return tx.Bucket(bucketMigrations).Put([]byte(id), record) })
}

// DeleteMigration forgets a migration.
func (s *Bolt) DeleteMigration(id string) error { return del(s.db, bucketMigrations, id) }

// Migrations returns every migration record by id.
func (s *Bolt) Migrations() (map[string]json.RawMessage, error) {
	out := map[string]json.RawMessage{}
	err := s.db.View(func(tx *bolt.Tx) error {
		return tx.Bucket(bucketMigrations).ForEach(func(k, v []byte) error {
			out[string(k)] = append(json.RawMessage(nil), v...)
			return nil
		})
	})
	return out, err
}

// PutLaunched writes a launched engine's record.
func (s *Bolt) PutLaunched(l Launched) error { return put(s.db, bucketLaunched, l.ID, l) }

// DeleteLaunched forgets a launched engine.
func (s *Bolt) DeleteLaunched(id string) error { return del(s.db, bucketLaunched, id) }

// LaunchedEngines returns every launched engine's record.
func (s *Bolt) LaunchedEngines() ([]Launched, error) { return all[Launched](s.db, bucketLaunched) }
