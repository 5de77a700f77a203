// Package store is the Host's durable state: what it decided about each
// instance (role, lifecycle), the record of every migration and the
// engines it launched — in an embedded bbolt database under the Host's
// data directory (bolt.go, one Host), or in etcd (etcd.go), where several
// Hosts share it and one leads. A Host that restarts — cleanly or by
// kill -9 — or that takes over from another reads them back, so routing
// goes to the instance a migration made active, a retired engine stays
// retired, and `vhi migration status` still answers for migrations
// before.
package store

import (
	"encoding/json"
	"time"
)

// Instance is what the Host keeps of one instance across restarts.
type Instance struct {
	ID           string    `json:"vllm_hi_id"`
	Type         string    `json:"type"`
	Role         string    `json:"role"`
	Retired      bool      `json:"retired,omitempty"`
	Draining     bool      `json:"draining,omitempty"`
	EngineURL    string    `json:"engine_url"`
	ServedModels []string  `json:"served_model_names"`
	RegisteredAt time.Time `json:"registered_at"`
	// Departed: the agent deregistered (a clean stop). The record stays so
	// a restarted agent gets its role back; it is not listed meanwhile.
	Departed bool      `json:"departed,omitempty"`
	LastSeen time.Time `json:"last_seen"`
}

// Launched is an engine the Host started (a replica of a scale-out) and
// stops when it takes it out: kept so that a restarted Host still can.
// PID and Start (its start time, in clock ticks after boot) name the
// process; a pid alone may have been reused.
type Launched struct {
	ID      string    `json:"vllm_hi_id"`
	Model   string    `json:"model"`
	PID     int       `json:"pid"`
	Start   uint64    `json:"start_ticks"`
	LogFile string    `json:"log_file"`
	At      time.Time `json:"launched_at"`
}

// Store is what the Host keeps. Implementations are safe for concurrent
// use.
type Store interface {
	PutInstance(Instance) error
	DeleteInstance(id string) error
	Instances() ([]Instance, error)
	// PutMigration writes a migration's record (its JSON) under id.
	PutMigration(id string, record json.RawMessage) error
	DeleteMigration(id string) error
	Migrations() (map[string]json.RawMessage, error)
	PutLaunched(Launched) error
	DeleteLaunched(id string) error
	LaunchedEngines() ([]Launched, error)
	// Lost is closed when this Host may no longer write — it stopped
	// leading a shared store (nil: never).
	Lost() <-chan struct{}
	Close() error
}
