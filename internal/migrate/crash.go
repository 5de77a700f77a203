package migrate

import "os"

// crashIf ends the Host at once when the migration was asked to inject
// fault (--allow-fault-injection): tests of a Host dying at that point,
// after which the engines' leases and the next Host must clean up. Its
// records are as a crash there finds them: each step's is written within
// milliseconds of the step, not at the exit.
func (m *migration) crashIf(fault, where string) {
	if m.req.InjectFault != fault {
		return
	}
	m.log.Error("injected fault: the Host exits " + where)
	m.o.rec.close()
	os.Exit(3)
}
